//! Known-answer tests for every XTS engine and both tweak modes.
//!
//! IEEE Std 1619-2007 Annex B vectors (whole-block vectors: 2, 4 and 10; vector 1 uses
//! Key1 = Key2 and must be refused), plus two 512-byte vectors for a multi-byte data-unit
//! number in each tweak layout, derived with pyca/cryptography (an implementation
//! independent of nacre's engines) and re-checked live against it (required:
//! `scripts/setup --test` installs it).

use nacre_dpu::crypto::xts::EngineKind;
use nacre_dpu::crypto::{CryptoError, TweakMode, UnitLayout, XtsKey};
use nacre_tests::xts_oracle::{hex, python_cryptography_available, to_hex};

/// IEEE 1619 Annex B Vector 4 (XTS-AES-128), data unit sequence number 0.
const V4_KEY: &str = "2718281828459045235360287471352631415926535897932384626433832795";
const V4_CT: &str = "
    27a7479befa1d476489f308cd4cfa6e2a96e4bbe3208ff25287dd3819616e89cc78cf7f5e543445f8333d8fa7f560000
    05279fa5d8b5e4ad40e736ddb4d35412328063fd2aab53e5ea1e0a9f332500a5df9487d07a5c92cc512c8866c7e860ce
    93fdf166a24912b422976146ae20ce846bb7dc9ba94a767aaef20c0d61ad02655ea92dc4c4e41a8952c651d33174be51
    a10c421110e6d81588ede82103a252d8a750e8768defffed9122810aaeb99f9172af82b604dc4b8e51bcb08235a6f434
    1332e4ca60482a4ba1a03b3e65008fc5da76b70bf1690db4eae29c5f1badd03c5ccf2a55d705ddcd86d449511ceb7ec3
    0bf12b1fa35b913f9f747a8afd1b130e94bff94effd01a91735ca1726acd0b197c4e5b03393697e126826fb6bbde8ecc
    1e08298516e2c9ed03ff3c1b7860f6de76d4cecd94c8119855ef5297ca67e9f3e7ff72b1e99785ca0a7e7720c5b36dc6
    d72cac9574c8cbbc2f801e23e56fd344b07f22154beba0f08ce8891e643ed995c94d9a69c9f1b5f499027a78572aeebd
    74d20cc39881c213ee770b1010e4bea718846977ae119f7a023ab58cca0ad752afe656bb3c17256a9f6e9bf19fdd5a38
    fc82bbe872c5539edb609ef4f79c203ebb140f2e583cb2ad15b4aa5b655016a8449277dbd477ef2c8d6c017db738b18d
    eb4a427d1923ce3ff262735779a418f20a282df920147beabe421ee5319d0568";

/// IEEE 1619 Annex B Vector 10 (XTS-AES-256), data unit sequence number 0xff.
const V10_KEY: &str = "2718281828459045235360287471352662497757247093699959574966967627
                       3141592653589793238462643383279502884197169399375105820974944592";
const V10_CT: &str = "
    1c3b3a102f770386e4836c99e370cf9bea00803f5e482357a4ae12d414a3e63b5d31e276f8fe4a8d66b317f9ac683f44
    680a86ac35adfc3345befecb4bb188fd5776926c49a3095eb108fd1098baec70aaa66999a72a82f27d848b21d4a741b0
    c5cd4d5fff9dac89aeba122961d03a757123e9870f8acf1000020887891429ca2a3e7a7d7df7b10355165c8b9a6d0a7d
    e8b062c4500dc4cd120c0f7418dae3d0b5781c34803fa75421c790dfe1de1834f280d7667b327f6c8cd7557e12ac3a0f
    93ec05c52e0493ef31a12d3d9260f79a289d6a379bc70c50841473d1a8cc81ec583e9645e07b8d9670655ba5bbcfecc6
    dc3966380ad8fecb17b6ba02469a020a84e18e8f84252070c13e9f1f289be54fbc481457778f616015e1327a02b140f1
    505eb309326d68378f8374595c849d84f4c333ec4423885143cb47bd71c5edae9be69a2ffeceb1bec9de244fbe15992b
    11b77c040f12bd8f6a975a44a0f90c29a9abc3d4d893927284c58754cce294529f8614dcd2aba991925fedc4ae74ffac
    6e333b93eb4aff0479da9a410e4450e0dd7ae4c6e2910900575da401fc07059f645e8b7e9bfdef33943054ff84011493
    c27b3429eaedb4ed5376441a77ed43851ad77f16f541dfd269d50d6a5f14fb0aab1cbb4c1550be97f7ab4066193c4caa
    773dad38014bd2092fa755c824bb5e54c4f36ffda9fcea70b9c6e693e148c151";

/// V10's key and plaintext, data unit 0x12_3456_789a, tweak mode plain64 (le64 in bytes 0..8).
const PLAIN64_123456789A_CT: &str = "
    50ea7b0e72da7912892bcd0c7496baa4b346523120af299dac5b9960aed521fb369169dcb0c7d652a3af8bd85e97b61c
    48a1dbefdee6b7bf1698d451d676d346bb26b05b6d6794e3c1544329529bc80a6c2d623b878b2c17459ddb669134caba
    4ef4202484f0b6afe707523fd5afc25d636f852f2be988192a28f4ccb2c16bc37924c841dc59e72dadeef07ee2030534
    6002c50d8405cd62fe3c209525850f7a52b58a875c69e782d418d492dcf1adf34bd636c8ab740171c9a8bf74ab00556f
    9fe32040211f5e715e86ff986231e29f87d8f1194763559ab28596120bbe6ab7cd298768a73de1a71bb66dbee8ffa853
    ac90585ea1d36f79eeefea7f1c190cad9446b9ab1428b6a8fc2801b9cd6105235d1371cd929c25db2886ab4f7048e21b
    5b39521e82361c20c14f09d58a29e9f99206c63bfa2f20b597a9ad4abbb8c404da024a178bffc454bfcd832444e60580
    bc360d13a88bf64103e477ee4f576027ed53d5451cfbbb600d05e2e101a27fd12ce1e56df07924d378e01ca52399b450
    837c0a60d66481d7683ec6870183569e010d104b568ba01594efa6fc6888fd172e34d0c3284903084f76ebed61f3ca0b
    1e41fc1cd554ce33edbe0b3ff4734c7432890bea739c5c6ed9dcfcecc18b93e7e95180d507fdaeff02803374034178ef
    8188c645244e66954f467524208cd45aa9551a82318463bf68ba7865c0ed31ec";

/// V10's key and plaintext, data unit 0x12_3456_789a, tweak mode be64 (be64 in bytes 8..16).
const BE64_123456789A_CT: &str = "
    81d26eadb9db99bbbada5e290c71514dad4941985e8d05b7bc826c5d1750155beac9caf58f19364ed275b7cc546d0dd3
    4fc3d1836d4842f08c589197a3a3b144a3d1a3cf2b3f3595ef6ca950000a0a209c80caae9d92f26bfd57e66916b9715f
    8a072f62147e450f79c0d783c8420da6d9a66cdb36dc01ae45fb14d49db74cb52cf394d03e85a609930ec30a21aa1f62
    088649a5a853f2a656ca352b34bd57acc7675400318050684e34f3befa548b821bca603891f8efdd64204b2e4899d91f
    d29bd8f324b5e11591d5bd4dc619cc29ae936b4e2a6044ea8fc940598a8bfc5dd09235b83a272d7c39169d7a039bbd8e
    689220ad65a478ac364e9ddcc748acd0f1d503914081a684c5f1c7d5053c580cd9a2ed3045df7dde084cf87da80f8786
    964f43fcf7452e6ef524c687e9fbdf8d91d5101764d67769732422ca60a6330053f31e7b79e674840138a6605d479f81
    99fa5af25250c11140abeb3b8115d4e1a3bb9c0220310e6790e8ce3dc9c0e85380fa0acb60c8b5a60836942dcb3be30c
    d2a3cc6c4b486a5efcb010507f652ce2389d9b84fc322ff36c1b095d443316a93eb7143e8b88b5662f8832ead394398a
    bc0003310c70166d16fd64dcca01a71c0a0f7815c9549747e1ba545c4b39b98d3fdb77aab4816d02b6b60e3a724753af
    a554c87097df651ba313348358b32d397e0deab315d67044203005b6fd808009";

/// IEEE 1619 Annex B vectors 4 and 10 use the plaintext 00 01 .. ff 00 01 .. ff.
fn pt512() -> Vec<u8> {
    (0..512).map(|i| i as u8).collect()
}

fn engines_for(key: &XtsKey) -> Vec<Box<dyn nacre_dpu::crypto::XtsEngine>> {
    EngineKind::all()
        .iter()
        .filter_map(|k| match k.build(key) {
            Ok(e) => Some(e),
            // aws-lc has AES-256-XTS only; every other refusal is a failure.
            Err(CryptoError::Unsupported(_)) if key.len() == 32 && *k == EngineKind::AwsLc => None,
            Err(e) => panic!("{}: {e}", k.name()),
        })
        .collect()
}

/// Encrypt `pt` as data unit `unit` with every engine, compare with `ct`, decrypt back.
fn check_all_engines(key_hex: &str, mode: TweakMode, unit: u64, pt: &[u8], ct_hex: &str) {
    let key = XtsKey::from_bytes(&hex(key_hex)).unwrap();
    let ct = hex(ct_hex);
    let layout = UnitLayout::new(pt.len(), mode);
    let engines = engines_for(&key);
    assert!(
        engines.len() >= 3,
        "too few engines for a {}-byte key",
        key.len()
    );
    for e in engines {
        let mut buf = pt.to_vec();
        e.encrypt_in_place(layout, unit, &mut buf).unwrap();
        assert_eq!(to_hex(&buf), to_hex(&ct), "{} encrypt ({mode:?})", e.name());
        let mut out = vec![0u8; pt.len()];
        e.encrypt(layout, unit, pt, &mut out).unwrap();
        assert_eq!(out, ct, "{} out-of-place encrypt", e.name());
        e.decrypt_in_place(layout, unit, &mut buf).unwrap();
        assert_eq!(buf, pt, "{} decrypt ({mode:?})", e.name());
    }
}

#[test]
fn ieee1619_vector2_xts_aes_128() {
    // Key1 = 11.., Key2 = 22.., data unit 0x3333333333, 32 bytes of 0x44.
    check_all_engines(
        "1111111111111111111111111111111122222222222222222222222222222222",
        TweakMode::Plain64,
        0x33_3333_3333,
        &[0x44; 32],
        "c454185e6a16936e39334038acef838bfb186fff7480adc4289382ecd6d394f0",
    );
}

#[test]
fn ieee1619_vector4_xts_aes_128_512_bytes() {
    check_all_engines(V4_KEY, TweakMode::Plain64, 0, &pt512(), V4_CT);
}

#[test]
fn ieee1619_vector10_xts_aes_256_512_bytes() {
    check_all_engines(V10_KEY, TweakMode::Plain64, 0xff, &pt512(), V10_CT);
}

#[test]
fn unit_zero_is_the_same_in_both_tweak_modes() {
    // The all-zero tweak is the only one the two layouts share (vector 4 uses it).
    check_all_engines(V4_KEY, TweakMode::Be64, 0, &pt512(), V4_CT);
}

#[test]
fn plain64_puts_the_unit_number_little_endian_in_bytes_0_to_8() {
    check_all_engines(
        V10_KEY,
        TweakMode::Plain64,
        0x12_3456_789a,
        &pt512(),
        PLAIN64_123456789A_CT,
    );
}

#[test]
fn be64_puts_the_unit_number_big_endian_in_bytes_8_to_16() {
    check_all_engines(
        V10_KEY,
        TweakMode::Be64,
        0x12_3456_789a,
        &pt512(),
        BE64_123456789A_CT,
    );
}

#[test]
fn ieee1619_vector1_equal_halves_is_refused() {
    // Vector 1 has Key1 = Key2 = 0; nacre refuses such keys before any engine sees them.
    assert!(matches!(
        XtsKey::from_bytes(&[0u8; 32]),
        Err(CryptoError::EqualKeyHalves)
    ));
    assert!(matches!(
        XtsKey::from_bytes(&[0u8; 64]),
        Err(CryptoError::EqualKeyHalves)
    ));
}

#[test]
fn engines_agree_on_many_units_of_4096_and_512_bytes() {
    // Consecutive units in one call must use consecutive unit numbers in every engine.
    let key = XtsKey::generate(64).unwrap();
    let data: Vec<u8> = (0..64 * 1024u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    for unit_len in [512usize, 4096] {
        for mode in [TweakMode::Plain64, TweakMode::Be64] {
            let layout = UnitLayout::new(unit_len, mode);
            let first = (1u64 << 40) - 3; // crosses a byte boundary of the unit number
            let mut reference: Option<Vec<u8>> = None;
            for e in engines_for(&key) {
                let mut buf = data.clone();
                e.encrypt_in_place(layout, first, &mut buf).unwrap();
                for (u, (c, p)) in buf.chunks(unit_len).zip(data.chunks(unit_len)).enumerate() {
                    assert_ne!(c, p, "{} left unit {u} in plaintext", e.name());
                }
                // Unit k of a batch equals that unit encrypted alone at number first + k.
                let k = 5;
                let mut single = data[k * unit_len..(k + 1) * unit_len].to_vec();
                e.encrypt_in_place(layout, first + k as u64, &mut single)
                    .unwrap();
                assert_eq!(
                    single,
                    buf[k * unit_len..(k + 1) * unit_len],
                    "{}",
                    e.name()
                );
                match &reference {
                    None => reference = Some(buf),
                    Some(r) => assert!(*r == buf, "{} disagrees ({unit_len}, {mode:?})", e.name()),
                }
            }
        }
    }
}

#[test]
fn derived_vectors_match_pyca_cryptography_live() {
    // The independent oracle is required, as in every other XTS test: a machine without it
    // must fail here, not pass without checking (scripts/setup --test installs it).
    assert!(
        python_cryptography_available(),
        "python3 cannot import cryptography: run scripts/setup --test (or apt-get install \
         python3-cryptography; pip install cryptography for a non-Debian python3)"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ct");
    let unit = 0x12_3456_789au64;
    for (mode, ct) in [
        ("plain64", PLAIN64_123456789A_CT),
        ("be64", BE64_123456789A_CT),
    ] {
        std::fs::write(&path, hex(ct)).unwrap();
        let pt = nacre_tests::xts_oracle::python_decrypt_file(
            &path,
            &hex(V10_KEY),
            512,
            mode,
            0,
            512,
            unit,
        )
        .unwrap();
        assert_eq!(pt, pt512(), "{mode}");
    }
}
