//! `tenant_*` methods, the key managers KMS tenants use (`kms_*`), and the key operations
//! on encrypted volumes (`volume_crypto_erase`, `volume_export_key`).

use std::path::PathBuf;

use nacre_shared::api::tenant::{
    KmsAdd, TenantCreate, TenantDelete, TenantList, TenantName, TenantPolicySet, TenantRotateKek,
    TenantUnlock, VolumeCryptoErase, VolumeExportKey,
};
use nacre_shared::api::Ack;
use serde_json::{json, Value};

use super::daemon::Daemon;
use super::error::RpcError;
use super::method::{parse_params, to_value, Method};

pub const METHODS: &[Method] = &[
    Method {
        name: "tenant_create",
        handler: tenant_create,
        help: "Create a tenant: name, kek {key_file | passphrase | kms + kms_key_id}, policy {cipher, data_unit, tweak, require_encryption}.",
    },
    Method {
        name: "tenant_list",
        handler: tenant_list,
        help: "List tenants (optionally one: name).",
    },
    Method {
        name: "tenant_show",
        handler: tenant_show,
        help: "Show a tenant, its KEK source, policy and volumes: name.",
    },
    Method {
        name: "tenant_delete",
        handler: tenant_delete,
        help: "Delete a tenant: name; refused while it has volumes unless force.",
    },
    Method {
        name: "tenant_unlock",
        handler: tenant_unlock,
        help: "Give nacred a tenant's KEK (passphrase tenants after a restart; KMS tenants ask their key manager) and open its encrypted volumes: name, kek.",
    },
    Method {
        name: "tenant_lock",
        handler: tenant_lock,
        help: "Forget a KMS or passphrase tenant's KEK and withdraw its volumes' data keys (they fail I/O until tenant_unlock): name.",
    },
    Method {
        name: "kms_add",
        handler: kms_add,
        help: "Configure a KMIP key manager: name, address (HOST:PORT), ca, cert, key (absolute PEM paths), timeout_ms.",
    },
    Method {
        name: "kms_list",
        handler: kms_list,
        help: "List the configured key managers and the tenants each holds the KEK of.",
    },
    Method {
        name: "kms_delete",
        handler: kms_delete,
        help: "Remove a key manager no tenant uses: name.",
    },
    Method {
        name: "tenant_policy_set",
        handler: tenant_policy_set,
        help: "Change a tenant's encryption policy for new volumes: name, cipher, data_unit, tweak, require_encryption.",
    },
    Method {
        name: "tenant_policy_show",
        handler: tenant_policy_show,
        help: "Show a tenant's encryption policy: name.",
    },
    Method {
        name: "tenant_rotate_kek",
        handler: tenant_rotate_kek,
        help: "Re-wrap every data key of a tenant under a new KEK (no data rewritten): name, new_kek.",
    },
    Method {
        name: "volume_crypto_erase",
        handler: volume_crypto_erase,
        help: "Destroy an encrypted volume's data key so its data can never be read again: name, confirm.",
    },
    Method {
        name: "volume_export_key",
        handler: volume_export_key,
        help: "Write an encrypted volume's plaintext data key to a new 0600 file for disaster recovery: name, path, confirm.",
    },
];

fn tenant_create(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: TenantCreate = parse_params(params)?;
    to_value(d.registry.create_tenant(&p.name, &p.kek, &p.policy)?)
}

fn tenant_list(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: TenantList = parse_params(params)?;
    to_value(d.registry.tenants(p.name.as_deref())?)
}

fn tenant_show(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: TenantName = parse_params(params)?;
    let mut one = d.registry.tenants(Some(&p.name))?;
    to_value(one.pop())
}

fn tenant_delete(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: TenantDelete = parse_params(params)?;
    d.registry.delete_tenant(&p.name, p.force)?;
    to_value(Ack { ok: true })
}

fn tenant_unlock(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: TenantUnlock = parse_params(params)?;
    let opened = d.registry.unlock_tenant(&p.name, &p.kek)?;
    to_value(json!({"ok": true, "opened": opened}))
}

fn tenant_lock(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: TenantName = parse_params(params)?;
    let locked = d.registry.lock_tenant(&p.name)?;
    to_value(json!({"ok": true, "locked": locked}))
}

fn kms_add(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: KmsAdd = parse_params(params)?;
    to_value(d.registry.add_kms(&p)?)
}

fn kms_list(d: &Daemon, _params: Value) -> Result<Value, RpcError> {
    to_value(d.registry.kms_list())
}

fn kms_delete(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: TenantName = parse_params(params)?;
    d.registry.delete_kms(&p.name)?;
    to_value(Ack { ok: true })
}

fn tenant_policy_set(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: TenantPolicySet = parse_params(params)?;
    to_value(d.registry.set_tenant_policy(&p.name, &p.policy())?)
}

fn tenant_policy_show(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: TenantName = parse_params(params)?;
    to_value(d.registry.tenant_policy(&p.name)?)
}

fn tenant_rotate_kek(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: TenantRotateKek = parse_params(params)?;
    to_value(d.registry.rotate_tenant_kek(&p.name, &p.new_kek)?)
}

fn volume_crypto_erase(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: VolumeCryptoErase = parse_params(params)?;
    if !p.confirm {
        return Err(RpcError::invalid_params(
            "crypto-erase makes the volume's data permanently unreadable: set confirm (--yes)",
        ));
    }
    d.registry.crypto_erase_volume(&p.name)?;
    to_value(Ack { ok: true })
}

fn volume_export_key(d: &Daemon, params: Value) -> Result<Value, RpcError> {
    let p: VolumeExportKey = parse_params(params)?;
    let path = PathBuf::from(&p.path);
    if !path.is_absolute() {
        return Err(RpcError::invalid_params(format!(
            "path must be absolute (got {})",
            p.path
        )));
    }
    d.registry.export_volume_key(&p.name, &path, p.confirm)?;
    to_value(json!({"ok": true, "path": p.path}))
}
