// bfloat16 products on AMX (Intel's tile matrix unit): the second engine behind
// llmserve_cpu::bf16_linear, on the same packed weight as its AVX-512 BF16 register tiles
// (bf16_linear.cpp), because that layout, [N/16, K/2, 16, 2], is already AMX's: one
// 16 x 64-byte B tile (16 k-pairs x 16 output channels) is 1 KiB of one block, contiguous.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace llmserve_amx {

// True when this build has AMX-BF16 code and the kernel let this process use the tile
// registers (Linux asks each process to request them: arch_prctl ARCH_REQ_XCOMP_PERM).
bool bf16_usable();

// y [M, N] = x [M, K] @ W.T, W packed [N/16, K/2, 16, 2]; x rows at stride ldx elements,
// K % 32 == 0, float32 sums rounded to bfloat16 (nearest even). Only when bf16_usable().
void bf16_product(const uint16_t* x, int64_t ldx, const uint16_t* w, c10::BFloat16* y, int64_t M, int64_t N,
                  int64_t K);

}  // namespace llmserve_amx
