//! Image ids. They are not ours to choose: ATF's ids match `tbbr_img_def.h`, UEFI's are defined
//! by Mellanox's `BfbFs` driver, and both are listed, in the order `mlx-mkbfb` emits them, in its
//! `image_list`. nacre writes only [`BOOT_ARGS`], [`IMAGE`] and [`INITRAMFS`]; an id missing
//! from the table (a newer vendor image) is carried through untouched and listed as unknown.

use std::fmt;

/// An image id (word 0 bits 56-63 of the header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ImageId(pub u8);

/// UEFI: arguments for the boot image (the kernel command line).
pub const BOOT_ARGS: ImageId = ImageId(59);
/// UEFI: the boot image (an arm64 Linux `Image`, EFI stub).
pub const IMAGE: ImageId = ImageId(62);
/// UEFI: the in-memory file system handed to the boot image.
pub const INITRAMFS: ImageId = ImageId(63);

/// (`mlx-mkbfb` option name, description, id), in `mlx-mkbfb`'s emission order.
pub const TABLE: &[(&str, &str, u8)] = &[
    ("psc-bl", "PSC bootloader image", 36),
    ("psc-fw", "PSC framework image", 37),
    ("bl2r-cert", "RIoT Core (BL2R) content certificate", 31),
    ("bl2r", "RIoT Core (BL2R) bin", 30),
    ("bl2-cert", "Trusted Boot Firmware BL2 certificate", 6),
    ("bl2", "Trusted Boot Firmware BL2 bin", 1),
    ("sys", "Running system's part number or PSID", 29),
    ("ddr-cert", "DDR Images Content Certificate", 38),
    ("ddr_ini", "DDR (pseudo SPD) parameters", 32),
    ("snps_images", "Combined SNPS images for all DIMM types", 33),
    ("ddr_ate_imem", "Analog Test Engine instructions", 34),
    ("ddr_ate_dmem", "Analog Test Engine data", 35),
    ("bl30-key-cert", "SCP Firmware BL3-0 key certificate", 8),
    ("bl30-cert", "SCP Firmware BL3-0 certificate", 12),
    ("bl30", "SCP Firmware BL3-0", 2),
    ("trusted-key-cert", "Trusted key certificate", 7),
    (
        "bl31-key-cert",
        "EL3 Runtime Firmware BL3-1 key certificate",
        9,
    ),
    (
        "bl31-cert",
        "EL3 Runtime Firmware BL3-1 content certificate",
        13,
    ),
    ("bl31", "EL3 Runtime Firmware BL3-1 bin", 3),
    ("psc-app", "PSC application image", 39),
    (
        "bl32-key-cert",
        "Secure Payload BL3-2 (Trusted OS) key certificate",
        10,
    ),
    (
        "bl32-cert",
        "Secure Payload BL3-2 (Trusted OS) content certificate",
        14,
    ),
    ("bl32", "Secure Payload BL3-2 (Trusted OS) bin", 4),
    (
        "bl33-key-cert",
        "Non-Trusted Firmware BL3-3 key certificate",
        11,
    ),
    (
        "bl33-cert",
        "Non-Trusted Firmware BL3-3 content certificate",
        15,
    ),
    ("bl33", "Non-Trusted Firmware BL3-3 bin", 5),
    ("capsule", "UEFI capsule image", 52),
    ("boot-acpi", "Name of the ACPI table", 55),
    ("boot-dtb", "Name of the dtb file", 56),
    ("boot-desc", "Default boot menu item description", 57),
    ("boot-path", "Boot image path", 58),
    ("boot-args", "Arguments for boot image", 59),
    ("boot-timeout", "Boot menu timeout", 60),
    ("uefi-tests", "Specify what UEFI tests to run", 61),
    ("ramdisk", "RAM Disk image", 54),
    ("image", "Boot image", 62),
    ("initramfs", "In-memory filesystem", 63),
];

impl ImageId {
    fn entry(self) -> Option<(usize, &'static (&'static str, &'static str, u8))> {
        TABLE.iter().enumerate().find(|(_, e)| e.2 == self.0)
    }

    /// The `mlx-mkbfb` option name (`image`, `initramfs`, `bl31`...), if the id is known.
    pub fn option_name(self) -> Option<&'static str> {
        self.entry().map(|(_, e)| e.0)
    }

    /// A description for listings ("unknown" for an id the table lacks).
    pub fn name(self) -> &'static str {
        self.entry().map_or("unknown", |(_, e)| e.1)
    }

    /// The id of an `mlx-mkbfb` option name.
    pub fn from_option_name(s: &str) -> Option<ImageId> {
        TABLE.iter().find(|e| e.0 == s).map(|e| ImageId(e.2))
    }

    /// Position in `mlx-mkbfb`'s emission order; unknown ids go last, by id.
    pub fn canonical_rank(self) -> usize {
        self.entry()
            .map_or(TABLE.len() + self.0 as usize, |(i, _)| i)
    }
}

impl fmt::Display for ImageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.option_name() {
            Some(n) => write!(f, "{} ({n})", self.0),
            None => write!(f, "{} (unknown)", self.0),
        }
    }
}
