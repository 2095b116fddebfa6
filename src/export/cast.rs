//! Element casts applied to the bytes on their way out, bit for bit as torch casts
//! (`tensor.to(torch.bfloat16)`, `tensor.to(torch.float16)` on the CPU): round to nearest,
//! ties to even.

use crate::dtype::Dtype;

/// A cast the export can apply on the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cast {
    /// Bytes kept as they are.
    Keep,
    /// F32 to BF16.
    F32ToBf16,
    /// F32 to F16.
    F32ToF16,
    /// BF16 to F32 (exact).
    Bf16ToF32,
}

impl Cast {
    /// The cast from `from` to the requested `to`; `None` when the export cannot make it.
    /// Non-floating dtypes are never cast (kept as they are).
    pub(crate) fn between(from: Dtype, to: Option<Dtype>) -> Option<(Cast, Dtype)> {
        let Some(to) = to else {
            return Some((Cast::Keep, from));
        };
        let float = matches!(from, Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64);
        if !float || from == to {
            return Some((Cast::Keep, from));
        }
        match (from, to) {
            (Dtype::F32, Dtype::BF16) => Some((Cast::F32ToBf16, to)),
            (Dtype::F32, Dtype::F16) => Some((Cast::F32ToF16, to)),
            (Dtype::BF16, Dtype::F32) => Some((Cast::Bf16ToF32, to)),
            _ => None,
        }
    }

    /// Append the cast of `src` (whole source elements) to `out`.
    pub(crate) fn apply(self, src: &[u8], out: &mut Vec<u8>) {
        match self {
            Cast::Keep => out.extend_from_slice(src),
            Cast::F32ToBf16 => {
                for c in src.chunks_exact(4) {
                    let f = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    out.extend_from_slice(&f32_to_bf16(f).to_le_bytes());
                }
            }
            Cast::F32ToF16 => {
                for c in src.chunks_exact(4) {
                    let f = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    out.extend_from_slice(&f32_to_f16(f).to_le_bytes());
                }
            }
            Cast::Bf16ToF32 => {
                for c in src.chunks_exact(2) {
                    let b = u16::from_le_bytes([c[0], c[1]]);
                    out.extend_from_slice(&(u32::from(b) << 16).to_le_bytes());
                }
            }
        }
    }
}

/// torch's `c10::BFloat16` rounding: NaN becomes the canonical quiet NaN `0x7FC0`, every
/// other value rounds to nearest, ties to even.
pub(crate) fn f32_to_bf16(f: f32) -> u16 {
    if f.is_nan() {
        return 0x7FC0;
    }
    let u = f.to_bits();
    let bias = 0x7FFF + ((u >> 16) & 1);
    (u.wrapping_add(bias) >> 16) as u16
}

/// torch's `c10::Half` conversion (`fp16_ieee_from_fp32_value`): round to nearest, ties to
/// even, through the float unit's own rounding; NaN becomes `sign | 0x7E00`.
pub(crate) fn f32_to_f16(f: f32) -> u16 {
    let scale_to_inf = f32::from_bits(0x7780_0000);
    let scale_to_zero = f32::from_bits(0x0880_0000);
    let mut base = (f.abs() * scale_to_inf) * scale_to_zero;
    let w = f.to_bits();
    let shl1_w = w.wrapping_add(w);
    let sign = w & 0x8000_0000;
    let bias = (shl1_w & 0xFF00_0000).max(0x7100_0000);
    base += f32::from_bits((bias >> 1) + 0x0780_0000);
    let bits = base.to_bits();
    let exp_bits = (bits >> 13) & 0x0000_7C00;
    let mantissa_bits = bits & 0x0000_0FFF;
    let nonsign = exp_bits + mantissa_bits;
    ((sign >> 16)
        | if shl1_w > 0xFF00_0000 {
            0x7E00
        } else {
            nonsign
        }) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (down to 1.0).
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3F80);
        // 1 + 3 * 2^-8 is halfway: ties to even (up).
        assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3F82);
        // Just above halfway rounds up.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8001)), 0x3F81);
        assert_eq!(f32_to_bf16(-2.0), 0xC000);
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7F80);
        assert_eq!(f32_to_bf16(f32::from_bits(0xFFC0_1234)), 0x7FC0);
        // The largest finite f32 rounds to infinity.
        assert_eq!(f32_to_bf16(f32::MAX), 0x7F80);
    }

    #[test]
    fn f16_rounds_to_nearest_even() {
        assert_eq!(f32_to_f16(1.0), 0x3C00);
        assert_eq!(f32_to_f16(-2.0), 0xC000);
        assert_eq!(f32_to_f16(65504.0), 0x7BFF);
        // Above the largest half (and past the rounding boundary): infinity.
        assert_eq!(f32_to_f16(65520.0), 0x7C00);
        assert_eq!(f32_to_f16(f32::INFINITY), 0x7C00);
        assert_eq!(f32_to_f16(f32::NAN), 0x7E00);
        // Smallest subnormal half, and half of it (a tie, to even: zero).
        assert_eq!(f32_to_f16(2f32.powi(-24)), 0x0001);
        assert_eq!(f32_to_f16(2f32.powi(-25)), 0x0000);
        assert_eq!(f32_to_f16(3.0 * 2f32.powi(-25)), 0x0002);
        // 1 + 2^-11 is halfway between 1 and the next half: ties to even (1.0).
        assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3C00);
        assert_eq!(f32_to_f16(1.0 + 3.0 * 2f32.powi(-11)), 0x3C02);
    }

    #[test]
    fn casts_only_floats_and_refuses_unknown_pairs() {
        assert_eq!(
            Cast::between(Dtype::I64, Some(Dtype::BF16)),
            Some((Cast::Keep, Dtype::I64))
        );
        assert_eq!(
            Cast::between(Dtype::F32, Some(Dtype::BF16)),
            Some((Cast::F32ToBf16, Dtype::BF16))
        );
        assert_eq!(Cast::between(Dtype::F64, Some(Dtype::BF16)), None);
        let mut out = Vec::new();
        Cast::Bf16ToF32.apply(&0x3F80u16.to_le_bytes(), &mut out);
        assert_eq!(out, 1.0f32.to_le_bytes());
    }
}
