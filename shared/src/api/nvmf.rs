//! `nvmf_*` methods: NVMe-oF subsystems, namespaces, listeners and hosts.
//! (Filled in by the NVMe/TCP target work.)
