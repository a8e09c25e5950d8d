//! The format as a specification: header bits, CRC, ordering, corruption, vendor replacement.

use super::*;
use crate::ids::{BOOT_ARGS, IMAGE, INITRAMFS};

fn ours() -> Vec<(ImageId, Vec<u8>)> {
    vec![
        (INITRAMFS, (0..1001u32).map(|i| (i * 7) as u8).collect()),
        (IMAGE, b"ARMd kernel image, 8-aligned..".to_vec()),
        (BOOT_ARGS, b"console=ttyAMA0 quiet".to_vec()),
    ]
}

/// A vendor-like bundle: firmware images, two versions of the boot image, our three ids.
fn vendor() -> Bundle {
    let mut imgs = vec![
        Image::new(ImageId(1), b"bl2 firmware".to_vec()).unwrap(),
        Image::new(ImageId(3), vec![0xa5; 333]).unwrap(),
        Image::new(ImageId(5), vec![0x5a; 4096]).unwrap(),
        Image::new(ImageId(52), b"capsule".to_vec()).unwrap(),
        Image::new(BOOT_ARGS, b"vendor args".to_vec()).unwrap(),
        Image::new(IMAGE, b"vendor kernel v0".to_vec()).unwrap(),
        Image::new(IMAGE, b"vendor kernel v1!".to_vec()).unwrap(),
        Image::new(INITRAMFS, b"vendor initramfs".to_vec()).unwrap(),
    ];
    imgs[1].header.reserved = 0x3; // a reserved nibble set: must survive byte for byte
    imgs[6].header.cur_img_ver = 1;
    let mut b = Bundle { images: imgs };
    b.link();
    b
}

#[test]
fn header_bits_match_bluefield_boot_h() {
    let img = Image::new(IMAGE, vec![1, 2, 3]).unwrap();
    let mut h = img.header;
    h.following_images = 1 << 63;
    h.cur_img_ver = 2;
    h.next_img_ver = 1;
    let b = h.to_bytes();
    // magic, little endian
    assert_eq!(&b[0..4], &[0x42, 0x66, 0x02, 0x13]);
    // byte 4: major (low nibble) 1, minor (high nibble) 2
    assert_eq!(b[4], 0x21);
    // byte 5: reserved (low) 0, next image version (high) 1
    assert_eq!(b[5], 0x10);
    // byte 6: current image version (low) 2, header length in words (high) 3
    assert_eq!(b[6], 0x32);
    // byte 7: image id
    assert_eq!(b[7], 62);
    assert_eq!(u32::from_le_bytes(b[8..12].try_into().unwrap()), 3);
    assert_eq!(
        u32::from_le_bytes(b[12..16].try_into().unwrap()),
        image_crc(&[1, 2, 3])
    );
    assert_eq!(u64::from_le_bytes(b[16..24].try_into().unwrap()), 1 << 63);
    assert_eq!(Header::parse(&b, 0).unwrap(), h);
}

#[test]
fn crc_is_ieee_over_data_and_padding() {
    // the CRC-32 check value of the IEEE polynomial
    let mut h = crc32fast::Hasher::new();
    h.update(b"123456789");
    assert_eq!(h.finalize(), 0xcbf4_3926);
    // 9 bytes pad to 16: the CRC covers the 7 zero bytes too
    let mut padded = b"123456789".to_vec();
    padded.extend([0u8; 7]);
    let mut h = crc32fast::Hasher::new();
    h.update(&padded);
    assert_eq!(image_crc(b"123456789"), h.finalize());
    assert_ne!(image_crc(b"123456789"), 0xcbf4_3926);
    assert_eq!(padding(0), 0);
    assert_eq!(padding(8), 0);
    assert_eq!(padding(9), 7);
}

#[test]
fn build_orders_like_mlx_mkbfb_and_links_following_images() {
    let b = Bundle::build(ours()).unwrap();
    let ids: Vec<u8> = b.images.iter().map(|i| i.header.image_id).collect();
    assert_eq!(ids, vec![59, 62, 63]);
    let fol: Vec<u64> = b.images.iter().map(|i| i.header.following_images).collect();
    assert_eq!(fol, vec![(1 << 62) | (1 << 63), 1 << 63, 0]);
    for i in &b.images {
        assert_eq!(
            (i.header.major, i.header.minor, i.header.header_words),
            (1, 2, 3)
        );
        assert_eq!(i.header.cur_img_ver, 0);
    }
}

#[test]
fn round_trip_returns_every_byte() {
    let b = Bundle::build(ours()).unwrap();
    let bytes = b.to_bytes();
    assert_eq!(bytes.len() % 8, 0);
    let back = Bundle::parse(&bytes).unwrap();
    assert_eq!(back, b);
    assert_eq!(back.to_bytes(), bytes);
    for (id, data) in ours() {
        assert_eq!(back.get(id).unwrap().data, data, "image {id}");
    }
    let dir = tempfile_dir();
    let files = back.extract(&dir, "").unwrap();
    let names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec!["boot-args-v0", "image-v0", "initramfs-v0"]);
    for (p, (_, data)) in files.iter().zip([&ours()[2], &ours()[1], &ours()[0]]) {
        assert_eq!(&std::fs::read(p).unwrap(), data);
    }
    std::fs::remove_dir_all(dir).unwrap();
}

fn tempfile_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "nacre-bfb-test-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn one_line(e: &Error) -> String {
    let s = e.to_string();
    assert!(!s.contains('\n'), "{s}");
    s
}

#[test]
fn corruption_is_a_one_line_error() {
    let good = Bundle::build(ours()).unwrap().to_bytes();
    let first_len = HEADER_LEN + 24; // boot args: 21 bytes + 3 padding

    // a flipped data byte of the second image
    let mut b = good.clone();
    b[first_len + HEADER_LEN + 5] ^= 1;
    let e = Bundle::parse(&b).unwrap_err();
    assert!(
        matches!(e, Error::Crc { id: 62, offset, .. } if offset == first_len as u64),
        "{e:?}"
    );
    assert!(one_line(&e).contains("CRC mismatch"));

    // a flipped padding byte: the CRC covers padding
    let mut b = good.clone();
    b[HEADER_LEN + 22] = 0xff;
    assert!(matches!(Bundle::parse(&b), Err(Error::Crc { id: 59, .. })));

    // a flipped CRC field
    let mut b = good.clone();
    b[12] ^= 0x80;
    assert!(matches!(Bundle::parse(&b), Err(Error::Crc { id: 59, .. })));

    // truncated inside the last image
    let e = Bundle::parse(&good[..good.len() - 9]).unwrap_err();
    assert!(matches!(e, Error::TruncatedImage { id: 63, .. }), "{e:?}");
    assert!(one_line(&e).contains("truncated"));

    // truncated inside a header
    let e = Bundle::parse(&good[..first_len + 10]).unwrap_err();
    assert!(
        matches!(e, Error::TruncatedHeader { have: 10, .. }),
        "{e:?}"
    );
    one_line(&e);

    // bad magic
    let mut b = good.clone();
    b[0] = b'X';
    let e = Bundle::parse(&b).unwrap_err();
    assert!(matches!(e, Error::BadMagic { offset: 0, .. }), "{e:?}");
    assert!(one_line(&e).contains("bad magic"));

    // garbage after the last image
    let mut b = good.clone();
    b.extend_from_slice(b"trailing garbage, not a header");
    assert!(matches!(Bundle::parse(&b), Err(Error::BadMagic { .. })));

    // bad versions: major 2; minor 3; major 0
    for byte4 in [0x22u8, 0x31, 0x20] {
        let mut b = good.clone();
        b[4] = byte4;
        let e = Bundle::parse(&b).unwrap_err();
        assert!(matches!(e, Error::BadVersion { offset: 0, .. }), "{e:?}");
        assert!(one_line(&e).contains("unsupported BFB header version"));
    }
    // minor 0 and 1 are older, compatible versions
    let mut b = good.clone();
    b[4] = 0x11;
    Bundle::parse(&b).unwrap();

    // a header length other than 3 words
    let mut b = good.clone();
    b[6] = 0x40;
    assert!(matches!(
        Bundle::parse(&b),
        Err(Error::BadHeaderLength { words: 4, .. })
    ));

    // a following-images bitmap that lies
    let mut b = good.clone();
    b[16] = 1;
    let e = Bundle::parse(&b).unwrap_err();
    assert!(matches!(e, Error::Following { id: 59, .. }), "{e:?}");
    one_line(&e);

    assert!(matches!(Bundle::parse(&[]), Err(Error::Empty)));
}

/// The stream bytes of image `i` of `b` (header, data, padding).
fn stream_slice(b: &Bundle, i: usize) -> Vec<u8> {
    let mut v = Vec::new();
    b.images[i].write_to(&mut v).unwrap();
    v
}

#[test]
fn replace_keeps_vendor_images_byte_for_byte() {
    let v = vendor();
    let vbytes = v.to_bytes();
    Bundle::parse(&vbytes).unwrap();
    let r = v.replace(ours()).unwrap();
    let rbytes = r.to_bytes();
    let back = Bundle::parse(&rbytes).unwrap();
    let ids: Vec<(u8, u8)> = back
        .images
        .iter()
        .map(|i| (i.header.image_id, i.header.cur_img_ver))
        .collect();
    // both vendor kernels (v0, v1) gave way to ours
    assert_eq!(
        ids,
        vec![(1, 0), (3, 0), (5, 0), (52, 0), (59, 0), (62, 0), (63, 0)]
    );
    // the firmware images: header and data identical, at the start of the stream
    let mut vendor_prefix = Vec::new();
    for i in 0..4 {
        vendor_prefix.extend(stream_slice(&v, i));
    }
    assert_eq!(&rbytes[..vendor_prefix.len()], &vendor_prefix[..]);
    assert_eq!(back.images[1].header.reserved, 3);
    for (id, data) in ours() {
        assert_eq!(back.get(id).unwrap().data, data);
    }
}

#[test]
fn replace_inserts_a_missing_id_where_mlx_mkbfb_would() {
    let mut v = vendor();
    v.images.retain(|i| i.id() != BOOT_ARGS);
    v.link();
    let r = v.replace(ours()).unwrap();
    let ids: Vec<u8> = r.images.iter().map(|i| i.header.image_id).collect();
    assert_eq!(ids, vec![1, 3, 5, 52, 59, 62, 63]);
    // the vendor headers gained only the boot-args bit; their data is untouched
    for i in 0..4 {
        let (a, b) = (&v.images[i], &r.images[i]);
        assert_eq!(a.data, b.data);
        assert_eq!(
            b.header.following_images,
            a.header.following_images | 1 << 59
        );
        let mut h = b.header;
        h.following_images = a.header.following_images;
        assert_eq!(h, a.header);
    }
    Bundle::parse(&r.to_bytes()).unwrap();
}

#[test]
fn builder_refuses_what_it_cannot_write() {
    let e = Bundle::build(vec![(IMAGE, vec![1]), (IMAGE, vec![2])]).unwrap_err();
    assert!(matches!(e, Error::Duplicate { id: 62, .. }));
    assert!(matches!(
        Image::new(ImageId(64), vec![]),
        Err(Error::IdOutOfRange(64))
    ));
}

#[test]
fn unknown_ids_are_carried_and_named_by_number() {
    let mut b = vendor();
    b.images
        .insert(0, Image::new(ImageId(40), b"future".to_vec()).unwrap());
    b.link();
    let back = Bundle::parse(&b.to_bytes()).unwrap();
    assert_eq!(back.images[0].file_name(), "image_id_40-v0");
    assert_eq!(back.images[0].id().name(), "unknown");
    let r = back.replace(ours()).unwrap();
    assert_eq!(r.images[0].data, b"future");
}

#[test]
fn write_is_atomic_and_readable() {
    let d = tempfile_dir();
    std::fs::create_dir_all(&d).unwrap();
    let p = d.join("x.bfb");
    let b = Bundle::build(ours()).unwrap();
    b.write(&p).unwrap();
    assert_eq!(Bundle::read(&p).unwrap(), b);
    assert_eq!(
        std::fs::read_dir(&d).unwrap().count(),
        1,
        "no temporary left behind"
    );
    let e = Bundle::read(&d.join("missing.bfb")).unwrap_err();
    assert!(one_line(&e).contains("missing.bfb"));
    std::fs::remove_dir_all(d).unwrap();
}
