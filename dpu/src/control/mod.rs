//! The control plane. (In progress.)
