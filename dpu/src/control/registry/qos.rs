//! QoS limits of volumes, tenants and the daemon: persisted in the state document and
//! applied to the live [`Qos`](crate::volume::qos::Qos) at once; and the statistics the QoS
//! layer keeps per open volume.

use nacre_shared::api::qos::{QosInfo, QosLimits};
use nacre_shared::api::validate_name;
use tracing::{info, warn};

use super::store::Registry;
use crate::control::error::RpcError;
use crate::control::state::{QosState, State};

/// What a QoS request applies to, as the request gives it: exactly one of a volume, a tenant
/// or the daemon (global); none, for `qos_show`, means every limit set.
#[derive(Debug, Clone, Copy)]
pub struct QosScope<'a> {
    pub volume: Option<&'a str>,
    pub tenant: Option<&'a str>,
    pub global: bool,
}

impl QosScope<'_> {
    fn any(&self) -> bool {
        self.volume.is_some() || self.tenant.is_some() || self.global
    }
}

/// Which object a target names, checked against the state.
enum Target {
    Volume(String),
    Tenant(String),
    Global,
}

impl Target {
    fn of(state: &State, t: QosScope<'_>) -> Result<Target, RpcError> {
        match (t.volume, t.tenant, t.global) {
            (Some(v), None, false) => {
                validate_name("volume", v).map_err(RpcError::invalid_params)?;
                if !state.volumes.contains_key(v) {
                    return Err(RpcError::not_found("volume", v));
                }
                Ok(Target::Volume(v.to_string()))
            }
            (None, Some(t), false) => {
                validate_name("tenant", t).map_err(RpcError::invalid_params)?;
                if !state.tenants.contains_key(t) {
                    return Err(RpcError::not_found("tenant", t));
                }
                Ok(Target::Tenant(t.to_string()))
            }
            (None, None, true) => Ok(Target::Global),
            _ => Err(RpcError::invalid_params(
                "name exactly one of volume, tenant or global",
            )),
        }
    }

    fn get(&self, q: &QosState) -> Option<QosLimits> {
        match self {
            Target::Volume(v) => q.volumes.get(v).cloned(),
            Target::Tenant(n) => q.tenants.get(n).cloned(),
            Target::Global => q.global.clone(),
        }
    }

    fn put(&self, q: &mut QosState, l: Option<QosLimits>) {
        match (self, l) {
            (Target::Volume(v), Some(l)) => {
                q.volumes.insert(v.clone(), l);
            }
            (Target::Volume(v), None) => {
                q.volumes.remove(v);
            }
            (Target::Tenant(n), Some(l)) => {
                q.tenants.insert(n.clone(), l);
            }
            (Target::Tenant(n), None) => {
                q.tenants.remove(n);
            }
            (Target::Global, l) => q.global = l,
        }
    }

    fn info(&self, l: QosLimits) -> QosInfo {
        let (kind, name) = match self {
            Target::Volume(v) => ("volume", v.clone()),
            Target::Tenant(n) => ("tenant", n.clone()),
            Target::Global => ("global", "*".to_string()),
        };
        QosInfo {
            kind: kind.into(),
            name,
            limits: l,
        }
    }
}

impl Registry {
    /// Push persisted limits into the live limiter (nacred start, before volumes are
    /// reopened).
    /// Limits `qos_set` would refuse (a rate of 0, say: a hand-edited or damaged state file)
    /// are left out with a warning, as other records that cannot be replayed are: the
    /// limiter never divides by them.
    pub(super) fn apply_qos(&self, q: &QosState) {
        let valid = |what: String, l: &QosLimits| match l.validate() {
            Ok(()) => true,
            Err(e) => {
                warn!("saved QoS limits of {what} not applied: {e}");
                false
            }
        };
        for (v, l) in &q.volumes {
            if valid(format!("volume {v:?}"), l) {
                self.qos.set(Some(v), None, Some(l));
            }
        }
        for (t, l) in &q.tenants {
            if valid(format!("tenant {t:?}"), l) {
                self.qos.set(None, Some(t), Some(l));
            }
        }
        if let Some(l) = q
            .global
            .as_ref()
            .filter(|l| valid("the whole daemon".into(), l))
        {
            self.qos.set(None, None, Some(l));
        }
    }

    fn apply_one(&self, t: &Target, l: Option<&QosLimits>) {
        match t {
            Target::Volume(v) => self.qos.set(Some(v), None, l),
            Target::Tenant(n) => self.qos.set(None, Some(n), l),
            Target::Global => self.qos.set(None, None, l),
        }
    }

    /// `qos_set`: the given limits replace the target's, the others stay.
    pub fn set_qos(&self, target: QosScope<'_>, limits: &QosLimits) -> Result<QosInfo, RpcError> {
        limits.validate().map_err(RpcError::invalid_params)?;
        self.with(|inner| {
            let t = Target::of(&inner.state, target)?;
            if limits.weight.is_some() && !matches!(t, Target::Tenant(_)) {
                return Err(RpcError::invalid_params(
                    "weight applies to tenants (their share of the global limit)",
                ));
            }
            let merged = t.get(&inner.state.qos).unwrap_or_default().merged(limits);
            let mut next = inner.state.clone();
            t.put(&mut next.qos, Some(merged.clone()));
            self.commit(inner, next, || {})?;
            self.apply_one(&t, Some(&merged));
            info!(target = ?t.info(merged.clone()), "qos limits set");
            Ok(t.info(merged))
        })
    }

    /// `qos_clear`: every limit of the target goes.
    pub fn clear_qos(&self, target: QosScope<'_>) -> Result<(), RpcError> {
        self.with(|inner| {
            let t = Target::of(&inner.state, target)?;
            let mut next = inner.state.clone();
            t.put(&mut next.qos, None);
            self.commit(inner, next, || {})?;
            self.apply_one(&t, None);
            info!(target = ?t.info(QosLimits::default()).name, "qos limits cleared");
            Ok(())
        })
    }

    /// `qos_show`: the target's limits, or (no target) every limit set: global, tenants,
    /// volumes.
    pub fn qos_limits(&self, target: QosScope<'_>) -> Result<Vec<QosInfo>, RpcError> {
        self.with(|inner| {
            let q = &inner.state.qos;
            if target.any() {
                let t = Target::of(&inner.state, target)?;
                let l = t.get(q).unwrap_or_default();
                return Ok(vec![t.info(l)]);
            }
            let mut out: Vec<QosInfo> = Vec::new();
            if let Some(l) = &q.global {
                out.push(Target::Global.info(l.clone()));
            }
            out.extend(
                q.tenants
                    .iter()
                    .map(|(n, l)| Target::Tenant(n.clone()).info(l.clone())),
            );
            out.extend(
                q.volumes
                    .iter()
                    .map(|(v, l)| Target::Volume(v.clone()).info(l.clone())),
            );
            Ok(out)
        })
    }

    /// `stats_get`: the statistics of every open volume, or of the one named, by name.
    pub fn stats(
        &self,
        volume: Option<&str>,
    ) -> Result<Vec<nacre_shared::api::qos::VolumeStats>, RpcError> {
        if let Some(v) = volume {
            if !self.read_state(|s| s.volumes.contains_key(v)) {
                return Err(RpcError::not_found("volume", v));
            }
        }
        let mut stats = self.qos.stats();
        stats.retain(|s| volume.is_none_or(|v| s.volume == v));
        stats.sort_by(|a, b| a.volume.cmp(&b.volume));
        Ok(stats)
    }
}
