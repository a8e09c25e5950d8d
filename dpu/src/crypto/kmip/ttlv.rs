//! KMIP's Tag-Type-Length-Value encoding (KMIP 1.2 Specification §9.1 "TTLV Encoding").
//!
//! Each item is a 3-byte tag, a 1-byte type, a 4-byte big-endian length of the value, and
//! the value padded with zeros to a multiple of 8 bytes (§9.1.1.4, §9.1.2). Only the types
//! nacred's two operations need are built; the decoder accepts every type (skipping the
//! values it does not interpret) so an answer with extra attributes still parses.
//!
//! The decoder is bounded: nesting is limited, every length is checked against what is
//! left, and an item never reads past its enclosing structure.

use zeroize::Zeroizing;

/// Item types (§9.1.1.2, Table 191).
pub mod item_type {
    pub const STRUCTURE: u8 = 0x01;
    pub const INTEGER: u8 = 0x02;
    pub const LONG_INTEGER: u8 = 0x03;
    pub const BIG_INTEGER: u8 = 0x04;
    pub const ENUMERATION: u8 = 0x05;
    pub const BOOLEAN: u8 = 0x06;
    pub const TEXT_STRING: u8 = 0x07;
    pub const BYTE_STRING: u8 = 0x08;
    pub const DATE_TIME: u8 = 0x09;
    pub const INTERVAL: u8 = 0x0A;
}

/// Tags (§9.1.3.1, Table 193) used by the Encrypt and Decrypt operations.
pub mod tag {
    pub const BATCH_COUNT: u32 = 0x42000D;
    pub const BATCH_ITEM: u32 = 0x42000F;
    pub const BLOCK_CIPHER_MODE: u32 = 0x420011;
    pub const CRYPTOGRAPHIC_ALGORITHM: u32 = 0x420028;
    pub const CRYPTOGRAPHIC_PARAMETERS: u32 = 0x42002B;
    pub const IV_COUNTER_NONCE: u32 = 0x42003D;
    pub const OPERATION: u32 = 0x42005C;
    pub const PADDING_METHOD: u32 = 0x42005F;
    pub const PROTOCOL_VERSION: u32 = 0x420069;
    pub const PROTOCOL_VERSION_MAJOR: u32 = 0x42006A;
    pub const PROTOCOL_VERSION_MINOR: u32 = 0x42006B;
    pub const REQUEST_HEADER: u32 = 0x420077;
    pub const REQUEST_MESSAGE: u32 = 0x420078;
    pub const REQUEST_PAYLOAD: u32 = 0x420079;
    pub const RESPONSE_HEADER: u32 = 0x42007A;
    pub const RESPONSE_MESSAGE: u32 = 0x42007B;
    pub const RESPONSE_PAYLOAD: u32 = 0x42007C;
    pub const RESULT_MESSAGE: u32 = 0x42007D;
    pub const RESULT_REASON: u32 = 0x42007E;
    pub const RESULT_STATUS: u32 = 0x42007F;
    pub const UNIQUE_IDENTIFIER: u32 = 0x420094;
    pub const DATA: u32 = 0x4200C2;
}

/// Deepest nesting the decoder follows (a KMIP response is about four levels deep).
const MAX_DEPTH: usize = 16;

/// One decoded or to-be-encoded item. Byte strings are held in zeroize-on-drop buffers:
/// the `Data` of a Decrypt answer is a plaintext key.
#[derive(PartialEq, Eq)]
pub enum Item {
    Structure(u32, Vec<Item>),
    Integer(u32, i32),
    Enumeration(u32, u32),
    Boolean(u32, bool),
    Text(u32, String),
    Bytes(u32, Zeroizing<Vec<u8>>),
    /// Any other type: tag and type kept, value dropped.
    Other(u32, u8),
}

impl std::fmt::Debug for Item {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Item::Structure(t, v) => write!(f, "{t:06X}{v:?}"),
            Item::Integer(t, v) => write!(f, "{t:06X}={v}"),
            Item::Enumeration(t, v) => write!(f, "{t:06X}=enum {v}"),
            Item::Boolean(t, v) => write!(f, "{t:06X}={v}"),
            Item::Text(t, v) => write!(f, "{t:06X}={v:?}"),
            // Byte strings may be keys: only their length.
            Item::Bytes(t, v) => write!(f, "{t:06X}=<{} bytes>", v.len()),
            Item::Other(t, ty) => write!(f, "{t:06X}=<type {ty:#x}>"),
        }
    }
}

/// Why an answer could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed KMIP message: {0}")]
pub struct DecodeError(pub String);

impl Item {
    pub fn tag(&self) -> u32 {
        match self {
            Item::Structure(t, _)
            | Item::Integer(t, _)
            | Item::Enumeration(t, _)
            | Item::Boolean(t, _)
            | Item::Text(t, _)
            | Item::Bytes(t, _)
            | Item::Other(t, _) => *t,
        }
    }

    /// The first child with `tag`, for structures.
    pub fn child(&self, tag: u32) -> Option<&Item> {
        match self {
            Item::Structure(_, v) => v.iter().find(|i| i.tag() == tag),
            _ => None,
        }
    }

    /// Append the encoding to `out` (a zeroize-on-drop buffer: requests carry keys).
    pub fn encode(&self, out: &mut Zeroizing<Vec<u8>>) {
        let head = |out: &mut Vec<u8>, tag: u32, ty: u8, len: usize| {
            out.extend_from_slice(&tag.to_be_bytes()[1..]);
            out.push(ty);
            out.extend_from_slice(&(len as u32).to_be_bytes());
        };
        let pad = |out: &mut Vec<u8>, len: usize| {
            out.resize(out.len() + (8 - len % 8) % 8, 0);
        };
        match self {
            Item::Structure(t, items) => {
                let at = out.len();
                head(out, *t, item_type::STRUCTURE, 0);
                for i in items {
                    i.encode(out);
                }
                let len = (out.len() - at - 8) as u32;
                out[at + 4..at + 8].copy_from_slice(&len.to_be_bytes());
            }
            Item::Integer(t, v) => {
                head(out, *t, item_type::INTEGER, 4);
                out.extend_from_slice(&v.to_be_bytes());
                pad(out, 4);
            }
            Item::Enumeration(t, v) => {
                head(out, *t, item_type::ENUMERATION, 4);
                out.extend_from_slice(&v.to_be_bytes());
                pad(out, 4);
            }
            Item::Boolean(t, v) => {
                head(out, *t, item_type::BOOLEAN, 8);
                out.extend_from_slice(&u64::from(*v).to_be_bytes());
            }
            Item::Text(t, s) => {
                head(out, *t, item_type::TEXT_STRING, s.len());
                out.extend_from_slice(s.as_bytes());
                pad(out, s.len());
            }
            Item::Bytes(t, b) => {
                head(out, *t, item_type::BYTE_STRING, b.len());
                out.extend_from_slice(b);
                pad(out, b.len());
            }
            Item::Other(..) => {}
        }
    }

    /// Decode exactly one item filling `buf`.
    pub fn decode(buf: &[u8]) -> Result<Item, DecodeError> {
        let (item, used) = decode_one(buf, 0)?;
        if used != buf.len() {
            return Err(DecodeError(format!(
                "{} bytes after the message",
                buf.len() - used
            )));
        }
        Ok(item)
    }
}

/// The value length an item header announces; `None` until 8 bytes are there.
pub fn announced_len(header: &[u8]) -> Option<usize> {
    let h: [u8; 8] = header.get(..8)?.try_into().ok()?;
    Some(u32::from_be_bytes([h[4], h[5], h[6], h[7]]) as usize)
}

fn padded(len: usize) -> usize {
    len + (8 - len % 8) % 8
}

fn decode_one(buf: &[u8], depth: usize) -> Result<(Item, usize), DecodeError> {
    if depth > MAX_DEPTH {
        return Err(DecodeError("structures nested too deeply".into()));
    }
    if buf.len() < 8 {
        return Err(DecodeError("truncated item header".into()));
    }
    let tag = u32::from_be_bytes([0, buf[0], buf[1], buf[2]]);
    let ty = buf[3];
    let len = u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]) as usize;
    let body = &buf[8..];
    // Structures are not padded (their contents are); every other value is.
    let span = if ty == item_type::STRUCTURE {
        len
    } else {
        padded(len)
    };
    if span > body.len() {
        return Err(DecodeError(format!(
            "item {tag:06X} claims {len} bytes, {} left",
            body.len()
        )));
    }
    let v = &body[..len];
    let fixed = |want: usize| {
        if len == want {
            Ok(())
        } else {
            Err(DecodeError(format!(
                "item {tag:06X} of type {ty:#x} has length {len}, not {want}"
            )))
        }
    };
    let item = match ty {
        item_type::STRUCTURE => {
            let mut items = Vec::new();
            let mut at = 0;
            while at < len {
                let (i, used) = decode_one(&v[at..], depth + 1)?;
                items.push(i);
                at += used;
            }
            Item::Structure(tag, items)
        }
        item_type::INTEGER => {
            fixed(4)?;
            Item::Integer(tag, i32::from_be_bytes([v[0], v[1], v[2], v[3]]))
        }
        item_type::ENUMERATION => {
            fixed(4)?;
            Item::Enumeration(tag, u32::from_be_bytes([v[0], v[1], v[2], v[3]]))
        }
        item_type::BOOLEAN => {
            fixed(8)?;
            Item::Boolean(tag, v.iter().any(|b| *b != 0))
        }
        item_type::TEXT_STRING => Item::Text(
            tag,
            String::from_utf8(v.to_vec())
                .map_err(|_| DecodeError(format!("item {tag:06X}: text is not UTF-8")))?,
        ),
        item_type::BYTE_STRING => Item::Bytes(tag, Zeroizing::new(v.to_vec())),
        item_type::LONG_INTEGER
        | item_type::DATE_TIME
        | item_type::INTERVAL
        | item_type::BIG_INTEGER => Item::Other(tag, ty),
        other => {
            return Err(DecodeError(format!(
                "item {tag:06X} has unknown type {other:#x}"
            )))
        }
    };
    Ok((item, 8 + span))
}

#[cfg(test)]
mod test {
    use super::*;

    /// KMIP 1.2 Specification §9.1.2 gives example encodings; these are four of them.
    #[test]
    fn encodes_the_specification_examples() {
        let enc = |i: Item| {
            let mut v = Zeroizing::new(Vec::new());
            i.encode(&mut v);
            v.to_vec()
        };
        // "An Integer containing the decimal value 8".
        assert_eq!(
            enc(Item::Integer(0x420020, 8)),
            [0x42, 0x00, 0x20, 0x02, 0, 0, 0, 4, 0, 0, 0, 8, 0, 0, 0, 0]
        );
        // "An Enumeration with value 255".
        assert_eq!(
            enc(Item::Enumeration(0x420020, 255)),
            [0x42, 0x00, 0x20, 0x05, 0, 0, 0, 4, 0, 0, 0, 0xFF, 0, 0, 0, 0]
        );
        // "A Text String with the value 'Hello World'".
        assert_eq!(
            enc(Item::Text(0x420020, "Hello World".into())),
            [
                0x42, 0x00, 0x20, 0x07, 0, 0, 0, 0x0B, b'H', b'e', b'l', b'l', b'o', b' ', b'W',
                b'o', b'r', b'l', b'd', 0, 0, 0, 0, 0
            ]
        );
        // "A Structure containing an Enumeration, value 254, followed by an Integer, value 255".
        assert_eq!(
            enc(Item::Structure(
                0x420020,
                vec![
                    Item::Enumeration(0x420004, 254),
                    Item::Integer(0x420005, 255)
                ]
            )),
            [
                0x42, 0x00, 0x20, 0x01, 0, 0, 0, 0x20, 0x42, 0x00, 0x04, 0x05, 0, 0, 0, 4, 0, 0, 0,
                0xFE, 0, 0, 0, 0, 0x42, 0x00, 0x05, 0x02, 0, 0, 0, 4, 0, 0, 0, 0xFF, 0, 0, 0, 0
            ]
        );
    }

    #[test]
    fn round_trips_and_refuses_malformed_input() {
        let msg = Item::Structure(
            tag::RESPONSE_MESSAGE,
            vec![
                Item::Bytes(tag::DATA, Zeroizing::new(vec![1, 2, 3])),
                Item::Boolean(0x4200C5, true),
                Item::Text(tag::UNIQUE_IDENTIFIER, "1".into()),
            ],
        );
        let mut buf = Zeroizing::new(Vec::new());
        msg.encode(&mut buf);
        assert_eq!(Item::decode(&buf).unwrap(), msg);
        assert_eq!(announced_len(&buf), Some(buf.len() - 8));
        // Every truncation, and a length that overruns, is an error, never a panic.
        for cut in 0..buf.len() {
            assert!(Item::decode(&buf[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = buf.to_vec();
        long[7] = 0xF0;
        assert!(Item::decode(&long).is_err());
        // Deep nesting is refused.
        let mut deep = Item::Integer(1, 1);
        for _ in 0..20 {
            deep = Item::Structure(2, vec![deep]);
        }
        let mut buf = Zeroizing::new(Vec::new());
        deep.encode(&mut buf);
        assert!(Item::decode(&buf).unwrap_err().0.contains("deeply"));
        // The Debug form shows no byte-string contents.
        assert!(!format!("{msg:?}").contains("1, 2, 3"));
    }
}
