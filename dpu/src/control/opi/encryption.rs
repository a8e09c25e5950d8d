//! MiddleendEncryptionService: OPI's encrypted volumes. OPI hands over a raw data key; it is
//! checked (XTS only: two halves of 16 or 32 bytes that differ), and the request's copy is
//! zeroized. nacre encrypts a volume from its creation with a key it makes and wraps itself
//! (`volume_create` with `encrypt`), and cannot yet lay encryption over an existing volume
//! with a key it is given, so a valid request is answered FAILED_PRECONDITION.

use std::sync::Arc;

use tonic::{Request, Response, Status};
use zeroize::Zeroize;

use super::pb::{self, middleend_encryption_service_server::MiddleendEncryptionService};
use super::{blocking, invalid};
use crate::control::registry::Registry;

pub struct Service {
    pub registry: Arc<Registry>,
    /// The tenant whose KEK would wrap the keys (`--opi-tenant`).
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

impl Service {
    fn refuse(&self, mut m: pb::EncryptedVolume) -> Result<Response<pb::EncryptedVolume>, Status> {
        let checked = check_key(m.cipher, &m.key);
        m.key.zeroize();
        checked?;
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
                "tenant {tenant:?} is not unlocked: unlock it (nacre tenant unlock) first"
            )));
        }
        Err(Status::failed_precondition(
            "encrypting an existing volume with a given key is not available yet: create an \
             encrypted volume with nacre volume create --encrypt",
        ))
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
        let registry = self.registry.clone();
        let tenant = self.tenant.clone();
        blocking(move || {
            let m = m.ok_or_else(|| invalid("encrypted_volume is required"))?;
            Service { registry, tenant }.refuse(m)
        })
        .await
    }

    async fn update_encrypted_volume(
        &self,
        req: Request<pb::UpdateEncryptedVolumeRequest>,
    ) -> Result<Response<pb::EncryptedVolume>, Status> {
        let mut q = req.into_inner();
        let m = q.encrypted_volume.take();
        let registry = self.registry.clone();
        let tenant = self.tenant.clone();
        blocking(move || {
            let m = m.ok_or_else(|| invalid("encrypted_volume is required"))?;
            Service { registry, tenant }.refuse(m)
        })
        .await
    }

    async fn list_encrypted_volumes(
        &self,
        req: Request<pb::ListEncryptedVolumesRequest>,
    ) -> Result<Response<pb::ListEncryptedVolumesResponse>, Status> {
        let q = req.into_inner();
        super::page(q.page_size, &q.page_token)?;
        Ok(Response::new(pb::ListEncryptedVolumesResponse::default()))
    }

    async fn get_encrypted_volume(
        &self,
        req: Request<pb::GetEncryptedVolumeRequest>,
    ) -> Result<Response<pb::EncryptedVolume>, Status> {
        let q = req.into_inner();
        super::id_in(&q.name, "encryptedVolumes")?;
        Err(super::not_found(&q.name))
    }

    async fn delete_encrypted_volume(
        &self,
        req: Request<pb::DeleteEncryptedVolumeRequest>,
    ) -> Result<Response<()>, Status> {
        let q = req.into_inner();
        super::id_in(&q.name, "encryptedVolumes")?;
        if q.allow_missing {
            Ok(Response::new(()))
        } else {
            Err(super::not_found(&q.name))
        }
    }

    async fn stats_encrypted_volume(
        &self,
        req: Request<pb::StatsEncryptedVolumeRequest>,
    ) -> Result<Response<pb::StatsEncryptedVolumeResponse>, Status> {
        let q = req.into_inner();
        super::id_in(&q.name, "encryptedVolumes")?;
        Err(super::not_found(&q.name))
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
