//! virtio-blk over vhost-user. (In progress.)
