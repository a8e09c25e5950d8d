//! OPI resource names: which object of the state each name the OPI gRPC API handed out
//! stands for (`control::opi`). Bindings live in the same state document as the objects,
//! so both APIs see one state; a binding whose object was deleted through JSON-RPC is
//! dropped by the next OPI call that finds it stale.

use crate::control::error::RpcError;
use crate::control::state::OpiBinding;

use super::store::Registry;

impl Registry {
    /// The bindings whose names start with `prefix`, in name order.
    pub fn opi_bindings(&self, prefix: &str) -> Vec<(String, OpiBinding)> {
        self.read_state(|s| {
            s.opi
                .range(prefix.to_string()..)
                .take_while(|(k, _)| k.starts_with(prefix))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
    }

    /// The binding of one name.
    pub fn opi_binding(&self, name: &str) -> Option<OpiBinding> {
        self.read_state(|s| s.opi.get(name).cloned())
    }

    /// Bind (or rebind) `name`, persisted before it is visible.
    pub fn bind_opi(&self, name: &str, binding: OpiBinding) -> Result<(), RpcError> {
        self.with(|inner| {
            let mut next = inner.state.clone();
            next.opi.insert(name.to_string(), binding);
            self.commit(inner, next, || {})
        })
    }

    /// Forget `name` (and every name under it: `name/…`); nothing to forget is no error.
    pub fn unbind_opi(&self, name: &str) -> Result<(), RpcError> {
        self.with(|inner| {
            let under = format!("{name}/");
            let gone = |k: &String| k == name || k.starts_with(&under);
            if !inner.state.opi.keys().any(gone) {
                return Ok(());
            }
            let mut next = inner.state.clone();
            next.opi.retain(|k, _| !gone(k));
            self.commit(inner, next, || {})
        })
    }
}
