//! The BlueField boot stream (BFB): what `rshim` feeds a BlueField DPU's boot FIFO, and what a
//! `.bfb` file holds.
//!
//! # The format (Mellanox `bluefield_boot.h`, `mlx-mkbfb`)
//!
//! A stream of images, each an [image header](header) of three little-endian 64-bit words
//! (24 bytes) followed by the image's data, zero-padded to a multiple of 8 bytes:
//!
//! ```text
//! word 0: magic 0x13026642 (bits 0-31) | major (32-35) | minor (36-39) | reserved (40-43)
//!         | next image version (44-47) | this image's version (48-51)
//!         | header length in 8-byte words (52-55) | image id (56-63)
//! word 1: image length in bytes, without padding (0-31) | CRC-32 of data + padding (32-63)
//! word 2: bitmap of the ids of the images that follow this one in the stream
//! ```
//!
//! Image ids are fixed by the firmware (ARM Trusted Firmware's and UEFI's tables, see [`ids`]):
//! nacre only ever writes the boot image (62), the initramfs (63) and the boot arguments (59)
//! and keeps every other image of a vendor bundle byte for byte ([`Bundle::replace`]).
//!
//! The reader is as strict as `mlx-mkbfb -d`: bad magic, a major version other than 1, a minor
//! version above 2, a header length other than 3 words, a truncated header or image, or a CRC
//! that does not match are errors, each a one-line message naming the offset.

pub mod header;
pub mod ids;

use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};

pub use header::{Header, HEADER_LEN, MAGIC, MAJOR, MINOR};
pub use ids::ImageId;

/// Everything that can be wrong with a boot stream or a request to build one.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The four bytes where a header must start are not `0x13026642`.
    #[error("offset {offset}: bad magic {found:#010x} (a BFB image header starts with 0x13026642): not a BFB, or corrupted")]
    BadMagic { offset: u64, found: u32 },
    /// A header version this reader does not understand (`mlx-mkbfb` accepts major 1, minor <= 2).
    #[error("offset {offset}: unsupported BFB header version {major}.{minor} (this reader knows 1.0 to 1.{MINOR})")]
    BadVersion { offset: u64, major: u8, minor: u8 },
    /// A header length other than the 3 words every known version uses.
    #[error("offset {offset}: BFB header length {words} words; only 3 (24 bytes) is defined")]
    BadHeaderLength { offset: u64, words: u8 },
    /// The stream ends inside a header.
    #[error("offset {offset}: truncated BFB header ({have} of 24 bytes)")]
    TruncatedHeader { offset: u64, have: u64 },
    /// The stream ends inside an image's data or padding.
    #[error("offset {offset}: image {id} ({name}) truncated: header says {need} bytes with padding, {have} present")]
    TruncatedImage {
        offset: u64,
        id: u8,
        name: &'static str,
        need: u64,
        have: u64,
    },
    /// The CRC-32 in the header does not match the data and padding.
    #[error("offset {offset}: image {id} ({name}) CRC mismatch: header says {stored:#010x}, data has {computed:#010x}")]
    Crc {
        offset: u64,
        id: u8,
        name: &'static str,
        stored: u32,
        computed: u32,
    },
    /// The header's bitmap of following images does not list exactly the images that follow.
    #[error(
        "offset {offset}: image {id} ({name}) says images {stored:#x} follow, but {actual:#x} do"
    )]
    Following {
        offset: u64,
        id: u8,
        name: &'static str,
        stored: u64,
        actual: u64,
    },
    /// An empty stream holds no image.
    #[error("empty boot stream: no image header")]
    Empty,
    /// An image longer than the 32-bit length field.
    #[error("image {id} ({name}) is {len} bytes; a BFB image holds at most 4 GiB - 1")]
    TooLarge {
        id: u8,
        name: &'static str,
        len: u64,
    },
    /// The same image given twice to the builder.
    #[error("image {id} ({name}) given twice")]
    Duplicate { id: u8, name: &'static str },
    /// An image id outside the 64-bit following-images bitmap.
    #[error("image id {0} is outside the following-images bitmap (0-63)")]
    IdOutOfRange(u8),
    /// Reading or writing a file.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    fn io(path: &Path, source: std::io::Error) -> Self {
        Error::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Zero bytes that pad `len` bytes of data to the next multiple of 8.
pub fn padding(len: u64) -> u64 {
    (8 - len % 8) % 8
}

/// CRC-32 (IEEE 802.3, as zlib's `crc32`) of `data` followed by its zero padding: the value the
/// header's `image_crc` field holds.
pub fn image_crc(data: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(data);
    h.update(&[0u8; 8][..padding(data.len() as u64) as usize]);
    h.finalize()
}

/// One image of a boot stream: its header exactly as read (or built) and its data without
/// padding.
#[derive(Clone, PartialEq, Eq)]
pub struct Image {
    pub header: Header,
    pub data: Vec<u8>,
}

impl fmt::Debug for Image {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Image")
            .field("header", &self.header)
            .field("data_len", &self.data.len())
            .finish()
    }
}

impl Image {
    /// A new image (version 0) with its length and CRC computed; `following_images` is set when
    /// it is placed in a [`Bundle`].
    pub fn new(id: ImageId, data: Vec<u8>) -> Result<Image, Error> {
        let len = u32::try_from(data.len()).map_err(|_| Error::TooLarge {
            id: id.0,
            name: id.name(),
            len: data.len() as u64,
        })?;
        if id.0 >= 64 {
            return Err(Error::IdOutOfRange(id.0));
        }
        Ok(Image {
            header: Header {
                major: MAJOR,
                minor: MINOR,
                reserved: 0,
                next_img_ver: 0,
                cur_img_ver: 0,
                header_words: (HEADER_LEN / 8) as u8,
                image_id: id.0,
                image_len: len,
                image_crc: image_crc(&data),
                following_images: 0,
            },
            data,
        })
    }

    pub fn id(&self) -> ImageId {
        ImageId(self.header.image_id)
    }

    /// Bytes this image occupies in the stream: header, data, padding.
    pub fn stream_len(&self) -> u64 {
        HEADER_LEN as u64 + self.data.len() as u64 + padding(self.data.len() as u64)
    }

    /// The file name `mlx-mkbfb -x` gives this image: its option name (or `image_id_N`) and,
    /// from header minor version 2 on, `-vVERSION`.
    pub fn file_name(&self) -> String {
        let id = self.id();
        let mut n = match id.option_name() {
            Some(o) => o.to_string(),
            None => format!("image_id_{}", id.0),
        };
        if self.header.minor >= 2 {
            n.push_str(&format!("-v{}", self.header.cur_img_ver));
        }
        n
    }

    fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        w.write_all(&self.header.to_bytes())?;
        w.write_all(&self.data)?;
        w.write_all(&[0u8; 8][..padding(self.data.len() as u64) as usize])
    }
}

/// A whole boot stream: its images in stream order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Bundle {
    pub images: Vec<Image>,
}

/// Where an image sits in a stream (for listings).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub offset: u64,
    pub header: Header,
}

impl Bundle {
    /// Parse and verify a whole stream: every header, every CRC, and every following-images
    /// bitmap. The stream must end exactly after the last image's padding.
    pub fn parse(bytes: &[u8]) -> Result<Bundle, Error> {
        let mut images = Vec::new();
        let mut offset = 0usize;
        if bytes.is_empty() {
            return Err(Error::Empty);
        }
        while offset < bytes.len() {
            let off = offset as u64;
            let rest = &bytes[offset..];
            if rest.len() < HEADER_LEN {
                // A partial header whose first bytes are not the magic is garbage, not a cut.
                if rest.len() >= 4 {
                    let m = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes"));
                    if m != MAGIC {
                        return Err(Error::BadMagic {
                            offset: off,
                            found: m,
                        });
                    }
                }
                return Err(Error::TruncatedHeader {
                    offset: off,
                    have: rest.len() as u64,
                });
            }
            let header = Header::parse(rest[..HEADER_LEN].try_into().expect("24 bytes"), off)?;
            let id = ImageId(header.image_id);
            let len = header.image_len as usize;
            let padded = len as u64 + padding(len as u64);
            let body = &rest[HEADER_LEN..];
            if (body.len() as u64) < padded {
                return Err(Error::TruncatedImage {
                    offset: off,
                    id: id.0,
                    name: id.name(),
                    need: padded,
                    have: body.len() as u64,
                });
            }
            let mut h = crc32fast::Hasher::new();
            h.update(&body[..padded as usize]);
            let computed = h.finalize();
            if computed != header.image_crc {
                return Err(Error::Crc {
                    offset: off,
                    id: id.0,
                    name: id.name(),
                    stored: header.image_crc,
                    computed,
                });
            }
            images.push((
                off,
                Image {
                    header,
                    data: body[..len].to_vec(),
                },
            ));
            offset += HEADER_LEN + padded as usize;
        }
        // Following-images bitmaps: each header lists the ids of the images after it.
        let mut after = 0u64;
        for (off, img) in images.iter().rev() {
            if img.header.following_images != after {
                return Err(Error::Following {
                    offset: *off,
                    id: img.header.image_id,
                    name: img.id().name(),
                    stored: img.header.following_images,
                    actual: after,
                });
            }
            after |= 1u64.checked_shl(img.header.image_id as u32).unwrap_or(0);
        }
        Ok(Bundle {
            images: images.into_iter().map(|(_, i)| i).collect(),
        })
    }

    /// Read and verify a `.bfb` file.
    pub fn read(path: &Path) -> Result<Bundle, Error> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        Bundle::parse(&bytes)
    }

    /// A new bundle of `images` (each used once), in the order `mlx-mkbfb` emits them (the
    /// firmware's loading order: trusted firmware, then UEFI's boot options, then the boot image
    /// and initramfs).
    pub fn build(images: Vec<(ImageId, Vec<u8>)>) -> Result<Bundle, Error> {
        let mut out: Vec<Image> = Vec::with_capacity(images.len());
        for (id, data) in images {
            if out.iter().any(|i| i.id() == id) {
                return Err(Error::Duplicate {
                    id: id.0,
                    name: id.name(),
                });
            }
            out.push(Image::new(id, data)?);
        }
        out.sort_by_key(|i| i.id().canonical_rank());
        let mut b = Bundle { images: out };
        b.link();
        Ok(b)
    }

    /// This vendor bundle with nacre's images put in: every image of an id in `ours` (all its
    /// versions) is replaced by ours, at the position of the first; an id the vendor bundle
    /// lacks goes where `mlx-mkbfb` would put it. Every other image — firmware, certificates,
    /// UEFI capsule — keeps its header and data byte for byte (its following-images bitmap
    /// changes only if the set of ids after it changes, which only adding a new id can do).
    pub fn replace(&self, ours: Vec<(ImageId, Vec<u8>)>) -> Result<Bundle, Error> {
        let mut new: Vec<Image> = Vec::new();
        for (id, data) in ours {
            if new.iter().any(|i| i.id() == id) {
                return Err(Error::Duplicate {
                    id: id.0,
                    name: id.name(),
                });
            }
            new.push(Image::new(id, data)?);
        }
        let ids: Vec<ImageId> = new.iter().map(Image::id).collect();
        let mut new: Vec<Option<Image>> = new.into_iter().map(Some).collect();
        let mut out: Vec<Image> = Vec::with_capacity(self.images.len() + new.len());
        for img in &self.images {
            if !ids.contains(&img.id()) {
                out.push(img.clone());
            } else if let Some(slot) = new
                .iter_mut()
                .find(|n| n.as_ref().is_some_and(|n| n.id() == img.id()))
            {
                // the first image of a replaced id; its other versions are dropped
                out.push(slot.take().expect("found Some"));
            }
        }
        let new = new.into_iter().flatten();
        // Ids the vendor bundle did not have: before the first image that loads after them.
        for img in new {
            let rank = img.id().canonical_rank();
            let at = out
                .iter()
                .position(|o| o.id().canonical_rank() > rank)
                .unwrap_or(out.len());
            out.insert(at, img);
        }
        let mut b = Bundle { images: out };
        b.link();
        Ok(b)
    }

    /// Set every header's following-images bitmap and next-image version from the stream order
    /// (as `mlx-mkbfb` does when it writes a stream).
    fn link(&mut self) {
        let mut after = 0u64;
        let mut next_ver: Option<(u8, u8)> = None;
        for img in self.images.iter_mut().rev() {
            img.header.following_images = after;
            img.header.next_img_ver = match next_ver {
                Some((id, v)) if id == img.header.image_id => v,
                _ => 0,
            };
            next_ver = Some((img.header.image_id, img.header.cur_img_ver));
            after |= 1u64.checked_shl(img.header.image_id as u32).unwrap_or(0);
        }
    }

    /// The stream's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v =
            Vec::with_capacity(self.images.iter().map(Image::stream_len).sum::<u64>() as usize);
        self.write_to(&mut v).expect("writing to a Vec");
        v
    }

    pub fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        for i in &self.images {
            i.write_to(w)?;
        }
        Ok(())
    }

    /// Write the stream to `path` (through a temporary file renamed into place, so a failed
    /// build never leaves a half-written bundle under the final name).
    pub fn write(&self, path: &Path) -> Result<(), Error> {
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let name = path.file_name().ok_or_else(|| {
            Error::io(
                path,
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name"),
            )
        })?;
        let tmp = dir.join(format!(
            ".{}.tmp-{}",
            name.to_string_lossy(),
            std::process::id()
        ));
        let res = (|| {
            let f = std::fs::File::create(&tmp)?;
            let mut w = std::io::BufWriter::new(f);
            self.write_to(&mut w)?;
            let f = w.into_inner().map_err(|e| e.into_error())?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        if let Err(e) = res {
            let _ = std::fs::remove_file(&tmp);
            return Err(Error::io(path, e));
        }
        Ok(())
    }

    /// Each image's offset and header, in stream order.
    pub fn entries(&self) -> Vec<Entry> {
        let mut off = 0;
        self.images
            .iter()
            .map(|i| {
                let e = Entry {
                    offset: off,
                    header: i.header,
                };
                off += i.stream_len();
                e
            })
            .collect()
    }

    /// The first image with this id.
    pub fn get(&self, id: ImageId) -> Option<&Image> {
        self.images.iter().find(|i| i.id() == id)
    }

    /// Write every image's data into `dir` as `PREFIX<name>` (the names `mlx-mkbfb -x` uses;
    /// a second image of the same name and version gets `.1`, `.2`, ...). Returns the paths.
    pub fn extract(&self, dir: &Path, prefix: &str) -> Result<Vec<PathBuf>, Error> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let mut out: Vec<PathBuf> = Vec::new();
        for img in &self.images {
            let base = format!("{prefix}{}", img.file_name());
            let mut p = dir.join(&base);
            let mut n = 1;
            while out.contains(&p) {
                p = dir.join(format!("{base}.{n}"));
                n += 1;
            }
            std::fs::write(&p, &img.data).map_err(|e| Error::io(&p, e))?;
            out.push(p);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
