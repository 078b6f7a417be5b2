// The chunked kernel's ring, filled: a step's Q/K or V chunks into a ring slot (load_step: cp.async, issued by
// every thread), the first steps before the loop (cp.async), the cluster's and the ring's barriers, and the TMA
// producer warpgroup, whose one elected thread issues every step's copies. Text inside prefill_chunked (in
// prefill/chunked.cuh.jinja), in its scope, included where it stood.
  // Step s (0 <= s < STEPS) of KV tile `tile` into ring slot `slot`.
  // The step's column offset is made opaque to the compiler: otherwise, with the step loop
  // unrolled, it hoists every step's copy addresses out of the KV loop and holds them all (spills).
  auto opaque = [](int x) {
    asm volatile("" : "+r"(x));
    return x;
  };
  auto load_step = [&](int tile, int s, int slot) {
    T* dst = sRing + slot * STAGE_ELEMS;
    const int n0 = tile * BLOCK_N;
    if (s < QK_STEPS) {
      const int c0 = opaque(s * DK);
      auto col = [&](int c) { return c0 + c; };
      load_cols_async<LQ, BLOCK_M, DK, THREADS>(dst, gQ, p.q_ss, seqlen_q - m0, tid, col);
      load_cols_async<LK, BLOCK_N, DK, THREADS>(dst + BLOCK_M * (WGMMA ? DK : DK_ROW), gK + (long long)n0 * p.k_ss,
                                                p.k_ss, seqlen_k - n0, tid, col);
    } else {
      const int v = s - QK_STEPS;
      const int k0 = n0 + opaque((v / V_COL_STEPS) * VK);
      const int c0 = opaque((v % V_COL_STEPS) * VCW);
      if (V_TAIL && v % V_COL_STEPS == V_COL_STEPS - 1) {
        // The tail: column c of the block belongs to warpgroup c / 32, its column ON - 32 + c % 32.
        load_cols_async<LVT, VK, 64, THREADS>(dst, gV + (long long)k0 * p.v_ss, p.v_ss, seqlen_k - k0, tid,
                                              [&](int c) { return (c / 32) * ON + c0 + c % 32; });
      } else {
        // Step column c belongs to warp column c / VCW: output column (c / VCW) ON + c0 + c % VCW.
        load_cols_async<LV, VK, VC, THREADS, (DV_PAD > DV)>(dst, gV + (long long)k0 * p.v_ss, p.v_ss, seqlen_k - k0,
                                                            tid, [&](int c) { return (c / VCW) * ON + c0 + c % VCW; }, DV);
      }
    }
  };

  if constexpr (!TMA) {
    if (n_tiles > 0) {
#pragma unroll
      for (int s = 0; s < AHEAD; ++s) {
        load_step(tile_begin, s, s);
        cp_async_commit();
      }
    }
  }
  if constexpr (QK_PAIR || TMA) {
    if (tid == 0) {
      if constexpr (QK_PAIR) {
        WgmmaOps<BF16>::mbar_init(smem_addr(sXbar), THREADS);
        WgmmaOps<BF16>::mbar_init(smem_addr(sXbar + 1), THREADS);
      }
      if constexpr (TMA) {
#pragma unroll
        for (int s = 0; s < NUM_STAGES; ++s) {
          WgmmaOps<BF16>::mbar_init(full_bar(s), 1);
          WgmmaOps<BF16>::mbar_init(empty_bar(s), NUM_WARPS);
        }
        WgmmaOps<BF16>::mbar_init(q_bar, 1);
      }
      WgmmaOps<BF16>::mbar_init_fence();
    }
    if constexpr (QK_PAIR)
      cluster_sync();  // both CTAs have started, their barriers set, before either writes into the other
    else
      __syncthreads();
  }
  if constexpr (TMA) {
    // The producer warpgroup gives its registers to the consumers; its one elected thread issues every
    // step's copies, each into the next ring slot once the consumers have released it.
    using W = WgmmaOps<BF16>;
    if (warp >= NUM_WARPS) {
      W::template regs_dec<PRODUCER_REGS>();
      if (tid == THREADS) {
        int slot = 0, phase = 0;  // phase: the parity of the slot's current use, from the ring's first pass
        if (n_tiles > 0) {
          // Q's tile once (QK_PAIR: this CTA's half of its columns), in 64-column blocks
          W::mbar_expect(q_bar, Q_ELEMS * sizeof(T));
#pragma unroll
          for (int b = 0; b < QK_COLS / 64; ++b)
            W::tma_load(smem_addr(sQ) + b * LQ::BLOCK_BYTES, maps, q_bar, (QK_PAIR ? vs * QK_COLS : 0) + 64 * b, m0,
                        head, batch);
        }
        for (int it = 0; it < n_tiles; ++it) {
          const int n0 = (tile_begin + it) * BLOCK_N;
          for (int s = 0; s < STEPS; ++s) {
            if (it * STEPS + s >= NUM_STAGES) W::mbar_wait(empty_bar(slot), phase ^ 1);
            const unsigned dst = smem_addr(sRing + slot * STAGE_ELEMS);
            const unsigned bar = full_bar(slot);
            if (s < QK_STEPS) {
              W::mbar_expect(bar, BLOCK_N * DK * sizeof(T));
              const int c0 = (QK_PAIR ? vs * QK_COLS : 0) + s * DK;
#pragma unroll
              for (int b = 0; b < DK / 64; ++b)
                W::tma_load(dst + b * LK::BLOCK_BYTES, maps + 1, bar, c0 + 64 * b, n0, kv_head, batch);
            } else if (V_TAIL && (s - QK_STEPS) % V_COL_STEPS == V_COL_STEPS - 1) {
              // The tail step: one box of the 5-d map (32 columns, keys, the two warpgroups' tails, heads,
              // batch); TMA pads each 32-column row to the swizzle's 128 bytes, so each warpgroup's tail lands
              // in the first 32 columns of a block of its own (VK rows of 128 bytes).
              W::mbar_expect(bar, VK * 64 * sizeof(T));
              W::tma_load5(dst, maps + 3, bar, 0, n0 + ((s - QK_STEPS) / V_COL_STEPS) * VK, 2 * vs, kv_head, batch);
            } else {
              const int v = s - QK_STEPS;
              const int k0 = n0 + (v / V_COL_STEPS) * VK;
              const int c0 = vs * DV + (v % V_COL_STEPS) * VCW;
              W::mbar_expect(bar, VK * VC * sizeof(T));
              // block b of the step: warp column (64 b) / VCW's columns, (64 b) % VCW into them
#pragma unroll
              for (int b = 0; b < VC / 64; ++b)
                W::tma_load(dst + b * LV::BLOCK_BYTES, maps + 2, bar, c0 + (64 * b / VCW) * ON + (64 * b) % VCW, k0,
                            kv_head, batch);
            }
            if (++slot == NUM_STAGES) {
              slot = 0;
              phase ^= 1;
            }
          }
        }
      }
      return;
    }
    W::template regs_inc<CONSUMER_REGS>();
  }
