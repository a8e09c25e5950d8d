//! NVMe-oF/TCP target. (In progress.)
