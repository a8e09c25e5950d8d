//! Fabric initiators toward remote NVMe-oF storage. (Not yet: see the README.)
