//! MiddleendEncryptionService: OPI's encrypted volumes, an encryption layer over an existing
//! volume with a data key the client hands over. The key is checked (XTS only: two halves
//! of 16 or 32 bytes that differ), wrapped at once under the KEK of the `--opi-tenant`
//! tenant (which must exist and be unlocked) like nacre's own data keys, stored only
//! wrapped, and every copy of it in the request is zeroized. The layer is a nacre volume
//! named by the resource id (the id is the volume's name), which frontends name in
//! `volume_name_ref`; its binding keeps the client's spec without the key. Deleting it
//! leaves the base volume and its (cipher) data.

use std::sync::Arc;

use tonic::{Request, Response, Status};
use zeroize::Zeroize;

use super::pb::{self, middleend_encryption_service_server::MiddleendEncryptionService};
use super::{
    blocking, decode, encode, exists_differently, id_in, invalid, mask_paths, new_id, not_found,
    paginate, status, volume_ref, volume_stats,
};
use crate::control::registry::Registry;
use crate::control::state::OpiBinding;
use crate::crypto::keys::XtsKey;

const COLLECTION: &str = "encryptedVolumes";

pub struct Service {
    pub registry: Arc<Registry>,
    /// The tenant whose KEK wraps the keys (`--opi-tenant`).
    pub tenant: Option<String>,
}

/// Check an XTS key's cipher and length, and that its halves differ (IEEE 1619 §5.1 needs
/// two independent keys; equal halves void XTS's security).
pub(crate) fn check_key(cipher: i32, key: &[u8]) -> Result<(), Status> {
    use pb::EncryptionType as E;
    let half = match E::try_from(cipher) {
        Ok(E::AesXts128) => 16,
        Ok(E::AesXts256) => 32,
        Ok(E::AesXts192) => {
            return Err(invalid(
                "cipher AES_XTS_192 is not supported: use AES_XTS_128 or AES_XTS_256",
            ))
        }
        Ok(E::AesCbc128 | E::AesCbc192 | E::AesCbc256) => {
            return Err(invalid(
                "CBC ciphers are not supported for volumes: use AES_XTS_128 or AES_XTS_256",
            ))
        }
        _ => return Err(invalid("cipher is required: AES_XTS_128 or AES_XTS_256")),
    };
    if key.len() != 2 * half {
        return Err(invalid(format!(
            "key is {} bytes; this cipher takes {} (two {half}-byte halves)",
            key.len(),
            2 * half
        )));
    }
    if key[..half] == key[half..] {
        return Err(invalid(
            "key halves are equal: XTS needs two different keys",
        ));
    }
    Ok(())
}

/// The resource as stored and answered: the client's spec without its key.
fn keyless(name: &str, m: &pb::EncryptedVolume) -> pb::EncryptedVolume {
    pb::EncryptedVolume {
        name: name.to_string(),
        volume_name_ref: m.volume_name_ref.clone(),
        key: Vec::new(),
        cipher: m.cipher,
    }
}

/// The volume a binding of ours stands for, if it is still an encryption layer.
fn live_binding(r: &Registry, name: &str) -> Option<(OpiBinding, pb::EncryptedVolume)> {
    let b = r.opi_binding(name)?;
    let v = r.volumes(Some(&b.object)).ok()?.into_iter().next()?;
    v.over.as_ref()?;
    let spec = decode::<pb::EncryptedVolume>(&b.spec);
    Some((b, keyless(name, &spec)))
}

impl Service {
    /// The tenant whose KEK wraps OPI's keys, which must exist and be unlocked.
    fn tenant(&self) -> Result<String, Status> {
        let Some(tenant) = &self.tenant else {
            return Err(Status::failed_precondition(
                "no tenant is configured for OPI encrypted volumes (nacred --opi-tenant NAME)",
            ));
        };
        let unlocked = self
            .registry
            .tenants(Some(tenant))
            .ok()
            .and_then(|t| t.into_iter().next())
            .is_some_and(|t| t.unlocked);
        if !unlocked {
            return Err(Status::failed_precondition(format!(
                "tenant {tenant:?} does not exist or is not unlocked: create or unlock it (nacre tenant create / unlock) first"
            )));
        }
        Ok(tenant.clone())
    }

    /// Create (or find, for the same id, base, cipher and key) the layer `id`. The key is
    /// taken out of `m` and zeroized whatever happens.
    fn create(&self, id: &str, mut m: pb::EncryptedVolume) -> Result<pb::EncryptedVolume, Status> {
        let checked = check_key(m.cipher, &m.key)
            .and_then(|()| XtsKey::from_bytes(&m.key).map_err(|e| invalid(e.to_string())));
        m.key.zeroize();
        let key = checked?;
        let r = &self.registry;
        let id = new_id(id)?;
        let name = format!("{COLLECTION}/{id}");
        let base = volume_ref(r, &m.volume_name_ref)?;
        let want = keyless(&name, &m);
        let same_layer = |r: &Registry| -> Result<bool, Status> {
            let Some(v) = r.volumes(Some(&id)).ok().and_then(|v| v.into_iter().next()) else {
                return Ok(false);
            };
            Ok(v.over.as_deref() == Some(base.as_str())
                && r.volume_key_is(&id, &key).map_err(status)?)
        };
        if let Some((_, have)) = live_binding(r, &name) {
            return if have == want && same_layer(r)? {
                Ok(have)
            } else {
                Err(exists_differently(&name))
            };
        }
        let tenant = self.tenant()?;
        // A layer persisted whose binding was not (a failed earlier Create) is taken over.
        if !same_layer(r)? {
            r.create_encrypted_layer(&id, &base, &tenant, &key)
                .map_err(status)?;
        }
        r.bind_opi(
            &name,
            OpiBinding {
                object: id.clone(),
                spec: encode(&want),
            },
        )
        .map_err(status)?;
        Ok(want)
    }
}

#[tonic::async_trait]
impl MiddleendEncryptionService for Service {
    async fn create_encrypted_volume(
        &self,
        req: Request<pb::CreateEncryptedVolumeRequest>,
    ) -> Result<Response<pb::EncryptedVolume>, Status> {
        let mut q = req.into_inner();
        let m = q.encrypted_volume.take();
        let id = std::mem::take(&mut q.encrypted_volume_id);
        let svc = Service {
            registry: self.registry.clone(),
            tenant: self.tenant.clone(),
        };
        blocking(move || {
            let m = m.ok_or_else(|| invalid("encrypted_volume is required"))?;
            svc.create(&id, m).map(Response::new)
        })
        .await
    }

    /// The key and the base cannot change in place (a new key would need the data
    /// re-encrypted); `allow_missing` creates.
    async fn update_encrypted_volume(
        &self,
        req: Request<pb::UpdateEncryptedVolumeRequest>,
    ) -> Result<Response<pb::EncryptedVolume>, Status> {
        let mut q = req.into_inner();
        let m = q.encrypted_volume.take();
        let svc = Service {
            registry: self.registry.clone(),
            tenant: self.tenant.clone(),
        };
        blocking(move || {
            let mut m = m.ok_or_else(|| invalid("encrypted_volume is required"))?;
            let name = m.name.clone();
            let id = match id_in(&name, COLLECTION) {
                Ok(id) => id.to_string(),
                Err(e) => {
                    m.key.zeroize();
                    return Err(e);
                }
            };
            let Some((_, have)) = live_binding(&svc.registry, &name) else {
                if q.allow_missing {
                    return svc.create(&id, m).map(Response::new);
                }
                m.key.zeroize();
                return Err(not_found(&name));
            };
            // The same key (compared with the wrapped one) is no change.
            let same_key = XtsKey::from_bytes(&m.key)
                .ok()
                .map(|k| svc.registry.volume_key_is(&id, &k))
                .transpose()
                .map_err(status);
            m.key.zeroize();
            let same_key = same_key?.unwrap_or(false);
            let paths = mask_paths(&q.update_mask, &["volume_name_ref", "key", "cipher"])?;
            for p in paths {
                let changed = match p.as_str() {
                    "volume_name_ref" => m.volume_name_ref != have.volume_name_ref,
                    "cipher" => m.cipher != have.cipher,
                    _ => !same_key,
                };
                if changed {
                    return Err(invalid(format!(
                        "{p} cannot change in place: delete the encrypted volume and create it again"
                    )));
                }
            }
            Ok(Response::new(have))
        })
        .await
    }

    async fn list_encrypted_volumes(
        &self,
        req: Request<pb::ListEncryptedVolumesRequest>,
    ) -> Result<Response<pb::ListEncryptedVolumesResponse>, Status> {
        let q = req.into_inner();
        let p = super::page(q.page_size, &q.page_token)?;
        let r = &self.registry;
        let all = r
            .opi_bindings(&format!("{COLLECTION}/"))
            .into_iter()
            .filter_map(|(n, _)| live_binding(r, &n).map(|(_, v)| (n, v)))
            .collect();
        let (encrypted_volumes, next_page_token) = paginate(all, &p);
        Ok(Response::new(pb::ListEncryptedVolumesResponse {
            encrypted_volumes,
            next_page_token,
        }))
    }

    async fn get_encrypted_volume(
        &self,
        req: Request<pb::GetEncryptedVolumeRequest>,
    ) -> Result<Response<pb::EncryptedVolume>, Status> {
        let q = req.into_inner();
        id_in(&q.name, COLLECTION)?;
        live_binding(&self.registry, &q.name)
            .map(|(_, v)| Response::new(v))
            .ok_or_else(|| not_found(&q.name))
    }

    async fn delete_encrypted_volume(
        &self,
        req: Request<pb::DeleteEncryptedVolumeRequest>,
    ) -> Result<Response<()>, Status> {
        let q = req.into_inner();
        id_in(&q.name, COLLECTION)?;
        let r = self.registry.clone();
        blocking(move || {
            let Some((b, _)) = live_binding(&r, &q.name) else {
                r.unbind_opi(&q.name).map_err(status)?;
                return if q.allow_missing {
                    Ok(Response::new(()))
                } else {
                    Err(not_found(&q.name))
                };
            };
            // The layer and its wrapped key go; the base volume and its data stay.
            r.delete_volume(&b.object, false).map_err(status)?;
            r.unbind_opi(&q.name).map_err(status)?;
            Ok(Response::new(()))
        })
        .await
    }

    async fn stats_encrypted_volume(
        &self,
        req: Request<pb::StatsEncryptedVolumeRequest>,
    ) -> Result<Response<pb::StatsEncryptedVolumeResponse>, Status> {
        let q = req.into_inner();
        id_in(&q.name, COLLECTION)?;
        let (b, _) = live_binding(&self.registry, &q.name).ok_or_else(|| not_found(&q.name))?;
        Ok(Response::new(pb::StatsEncryptedVolumeResponse {
            stats: Some(volume_stats(&self.registry, &b.object)?),
        }))
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn xts_keys_are_checked() {
        let k = |n: usize| (0..n as u8).collect::<Vec<_>>();
        let xts128 = pb::EncryptionType::AesXts128 as i32;
        let xts256 = pb::EncryptionType::AesXts256 as i32;
        assert!(check_key(xts128, &k(32)).is_ok());
        assert!(check_key(xts256, &k(64)).is_ok());
        assert!(check_key(xts128, &k(31)).is_err());
        assert!(check_key(xts256, &k(32)).is_err());
        assert!(check_key(xts128, &[7; 32]).is_err());
        assert!(check_key(pb::EncryptionType::AesCbc256 as i32, &k(32)).is_err());
    }
}
