//! Element types: every dtype the safetensors format defines.

use std::fmt;
use std::str::FromStr;

/// A tensor element type, named as in the safetensors header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
#[non_exhaustive]
pub enum Dtype {
    /// Boolean, one byte.
    BOOL,
    /// 4-bit float (E2M1), two per byte.
    F4,
    /// 6-bit float (E2M3).
    F6_E2M3,
    /// 6-bit float (E3M2).
    F6_E3M2,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// 8-bit float, E5M2.
    F8_E5M2,
    /// 8-bit float, E4M3.
    F8_E4M3,
    /// 8-bit float, E8M0 (scale factors).
    F8_E8M0,
    /// 8-bit float, E4M3 without infinities, unsigned zero.
    F8_E4M3FNUZ,
    /// 8-bit float, E5M2 without infinities, unsigned zero.
    F8_E5M2FNUZ,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 16-bit integer.
    U16,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer.
    U32,
    /// IEEE single precision.
    F32,
    /// Complex of two f32.
    C64,
    /// IEEE double precision.
    F64,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 64-bit integer.
    U64,
}

impl Dtype {
    /// Every dtype, in the order above.
    pub const ALL: [Dtype; 22] = [
        Dtype::BOOL,
        Dtype::F4,
        Dtype::F6_E2M3,
        Dtype::F6_E3M2,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8_E5M2,
        Dtype::F8_E4M3,
        Dtype::F8_E8M0,
        Dtype::F8_E4M3FNUZ,
        Dtype::F8_E5M2FNUZ,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::C64,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];

    /// Bits per element.
    pub const fn bits(self) -> u64 {
        match self {
            Dtype::F4 => 4,
            Dtype::F6_E2M3 | Dtype::F6_E3M2 => 6,
            Dtype::BOOL
            | Dtype::U8
            | Dtype::I8
            | Dtype::F8_E5M2
            | Dtype::F8_E4M3
            | Dtype::F8_E8M0
            | Dtype::F8_E4M3FNUZ
            | Dtype::F8_E5M2FNUZ => 8,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 16,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 32,
            Dtype::C64 | Dtype::F64 | Dtype::I64 | Dtype::U64 => 64,
        }
    }

    /// Alignment a tensor of this dtype gets in the file (its element size; 1 for sub-byte
    /// types).
    pub const fn alignment(self) -> u64 {
        let bytes = self.bits() / 8;
        if bytes == 0 { 1 } else { bytes }
    }

    /// The safetensors name (`"BF16"`, `"F8_E4M3"`, ...).
    pub const fn as_str(self) -> &'static str {
        match self {
            Dtype::BOOL => "BOOL",
            Dtype::F4 => "F4",
            Dtype::F6_E2M3 => "F6_E2M3",
            Dtype::F6_E3M2 => "F6_E3M2",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8_E5M2 => "F8_E5M2",
            Dtype::F8_E4M3 => "F8_E4M3",
            Dtype::F8_E8M0 => "F8_E8M0",
            Dtype::F8_E4M3FNUZ => "F8_E4M3FNUZ",
            Dtype::F8_E5M2FNUZ => "F8_E5M2FNUZ",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::C64 => "C64",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }

    /// Bytes taken by `shape` elements of this dtype, or `None` on overflow or when a
    /// sub-byte dtype does not fill whole bytes (the safetensors rule).
    pub fn byte_len(self, shape: &[usize]) -> Option<u64> {
        let elems = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(u64::try_from(d).ok()?))?;
        let bits = elems.checked_mul(self.bits())?;
        if bits % 8 != 0 {
            return None;
        }
        Some(bits / 8)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Error parsing a dtype name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown dtype {0:?}")]
pub struct UnknownDtype(pub String);

impl FromStr for Dtype {
    type Err = UnknownDtype;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Dtype::ALL
            .iter()
            .copied()
            .find(|d| d.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownDtype(s.to_owned()))
    }
}

impl serde::Serialize for Dtype {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for Dtype {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_match_safetensors() {
        for d in Dtype::ALL {
            assert_eq!(d.as_str().parse::<Dtype>().unwrap(), d);
            let st: safetensors::Dtype =
                serde_json::from_str(&format!("\"{}\"", d.as_str())).unwrap();
            assert_eq!(st.bitsize() as u64, d.bits(), "{d}");
        }
        assert!("F128".parse::<Dtype>().is_err());
    }

    #[test]
    fn byte_len_checks_overflow_and_sub_byte() {
        assert_eq!(Dtype::F32.byte_len(&[2, 3]), Some(24));
        assert_eq!(Dtype::F32.byte_len(&[]), Some(4));
        assert_eq!(Dtype::F32.byte_len(&[0, 7]), Some(0));
        assert_eq!(Dtype::F4.byte_len(&[3]), None);
        assert_eq!(Dtype::F4.byte_len(&[4]), Some(2));
        assert_eq!(Dtype::F64.byte_len(&[usize::MAX, 2]), None);
        assert_eq!(Dtype::U8.byte_len(&[1 << 40, 1 << 30]), None);
    }
}
