"""The one implementation rule both FP8 quantizer modules follow (`temoe.moe.experts.quantizers`)."""

from __future__ import annotations

import pytest

from temoe.moe.experts import fp8_block, fp8_quant, quantizers


def test_auto_runs_xla_off_a_gpu_and_for_partial_tiles():
  assert quantizers.resolve("auto", "q", (256, 384), (128, 128)) == "xla"  # this host has no GPU
  assert fp8_quant.resolve("triton", (1, 64, 192)) == fp8_quant.resolve("triton", (1, 128, 200)) == "triton"
  assert fp8_quant.resolve(None, (1, 128, 128)) == fp8_block.resolve(None, 256, 256) == "xla"


@pytest.mark.parametrize("resolve,refusal", [
    # rows must be whole blocks; columns need not (the kernel masks its last column block)
    (lambda impl: fp8_quant.resolve(impl, (1, 96, 200)), r"cast_transpose: .* multiples of 64, got \(96,\)"),
    (lambda impl: fp8_quant.resolve(impl, (1, 64 + 8, 256)), r"cast_transpose: .* multiples of 64, got \(72,\)"),
    (lambda impl: fp8_block.resolve(impl, 256, 200), r"fp8_block: .* multiples of 128 x 128, got \(256, 200\)"),
], ids=["fp8_quant_rows", "fp8_quant_rows_ragged", "fp8_block"])
def test_both_modules_refuse_a_partial_tile_for_triton_and_an_unknown_impl(resolve, refusal):
  with pytest.raises(ValueError, match=refusal):
    resolve("triton")
  with pytest.raises(ValueError, match="impl 'cuda': choose one of auto, xla, triton"):
    resolve("cuda")
  assert resolve("xla") == "xla"


def test_arrays_whose_element_offsets_would_wrap_take_xla(monkeypatch):
  """Pallas' Triton lowering offsets in 32-bit signed arithmetic below 2^32 bytes: a 1-byte FP8 copy of
  2^31 elements or more would wrap, so `auto` takes XLA and an explicit triton is refused."""
  monkeypatch.setattr(quantizers.jax, "default_backend", lambda: "gpu")
  experts_80 = (80, 7168, 4096)  # 2.35e9 elements: between 2^31 and 2^32
  assert fp8_block.resolve(None, 7168, 4096, elements=7168 * 4096 * 64) == "triton"
  assert fp8_block.resolve(None, 7168, 4096, elements=7168 * 4096 * 80) == "xla"
  assert fp8_quant.resolve(None, experts_80) == "xla" and fp8_quant.resolve(None, (64, 7168, 4096)) == "triton"
  with pytest.raises(ValueError, match="fewer than 2\\^31 elements"):
    fp8_block.resolve("triton", 7168, 4096, elements=7168 * 4096 * 80)


@pytest.mark.parametrize("shape", [(3, 128, 1024), (2, 192, 320)], ids=["whole_blocks", "masked_tail"])
def test_the_backwards_weight_cast_is_the_forwards_copy(shape, monkeypatch):
  """The backward's cast of the weights from the forward's scales (`cast_experts`) gives the w_q the
  forward's cast-transpose wrote, bit for bit, whether that ran as the Triton kernel (Pallas' generic
  interpreter on CPU) or as XLA's expression; a NaN in an expert's weights reaches its amax."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  monkeypatch.setattr(fp8_quant, "INTERPRET", True)
  w = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(jnp.bfloat16)
  w = w.at[1].multiply(1e3)  # experts of different ranges: per-expert scales differ
  for impl in ("triton", "xla"):
    wq, _, s = fp8_quant.quantize_experts(w, fp8_quant.E4M3, impl)
    assert len(set(np.asarray(s).tolist())) == shape[0]
    for cast in ("xla", "triton"):  # the backward's cast itself: XLA's fusion, or the kernel writing q alone
      again = fp8_quant.cast_experts(w, s, fp8_quant.E4M3, impl=cast)
      assert again.dtype == wq.dtype and again.shape == wq.shape
      np.testing.assert_array_equal(np.asarray(again.astype(jnp.float32)), np.asarray(wq.astype(jnp.float32)))
  assert np.isnan(np.asarray(fp8_quant.weight_amax(w.at[0, 5, 7].set(jnp.nan))))[0]


def test_fp8_copies_of_2_31_elements_or_more_are_written_as_32_bit_words(monkeypatch):
  """An FP8 output too large for Pallas' 32-bit element offsets is written as words of four values and read
  back by a bitcast: the blockwise weights' two layouts and the cast-transpose's (a masked column tail too),
  bit-equal to XLA's in Pallas' interpreter (MAX_ELEMENTS lowered so small arrays take the packed form);
  `auto` takes them on a GPU, except where the columns are not whole words."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  monkeypatch.setattr(quantizers, "MAX_ELEMENTS", 1000)
  monkeypatch.setattr(fp8_block, "INTERPRET", True)
  monkeypatch.setattr(fp8_quant, "INTERPRET", True)
  w = jax.random.normal(jax.random.key(1), (3, 256, 384), jnp.float32)
  w = (w * jnp.asarray([1.0, 300.0, 0.01])[:, None, None]).astype(jnp.bfloat16)  # three experts' ranges
  for got, want in (*zip(fp8_block.quantize_weights(w, impl="triton"), fp8_block.quantize_weights(w, impl="xla")),
                    # packed and padded as read (masked loads), as a 2880-dim layer's wi
                    *zip(fp8_block.quantize_weights(w[:, :200, :300], impl="triton", padded=(256, 384)),
                         fp8_block.quantize_weights(w[:, :200, :300], impl="xla", padded=(256, 384)))):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
  scale = jax.random.uniform(jax.random.key(2), (3, 256), jnp.float32, 0.5, 4.0)
  for cols in (384, 200):  # 200: the last 128-column block masked, in words
    for got, want in zip(fp8_quant.cast_transpose(w[:, :, :cols], scale, fp8_quant.E4M3, "triton"),
                         fp8_quant.cast_transpose(w[:, :, :cols], scale, fp8_quant.E4M3, "xla")):
      assert got.dtype == want.dtype and got.shape == want.shape
      np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
  # packed and padded as read (current scaling's copy of a 2880-dim layer's wi: 128 x 2944 x 5760)
  for got, want in zip(fp8_quant.cast_transpose(w[:, :200, :300], scale, fp8_quant.E4M3, "triton", padded=(256, 384)),
                       fp8_quant.cast_transpose(w[:, :200, :300], scale, fp8_quant.E4M3, "xla", padded=(256, 384))):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
  alone = fp8_quant.cast_transposed(w[:, :200, :300], scale, fp8_quant.E4M3, "triton", padded=(256, 384))  # q^T alone
  np.testing.assert_array_equal(np.asarray(alone.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
  # q alone, the backward's cast of the weights from per-expert scales, packed and padded as read
  s = scale[:, 0]
  q_alone = fp8_quant.cast_experts(w[:, :200, :300], s, fp8_quant.E4M3, padded=(256, 384), impl="triton")
  q_xla = fp8_quant.cast_experts(w[:, :200, :300], s, fp8_quant.E4M3, padded=(256, 384), impl="xla")
  assert q_alone.shape == q_xla.shape == (3, 256, 384)
  np.testing.assert_array_equal(np.asarray(q_alone.astype(jnp.float32)), np.asarray(q_xla.astype(jnp.float32)))
  with pytest.raises(ValueError, match="fewer than 2\\^31 elements"):  # columns not whole words: not packed
    fp8_quant.cast_transpose(w[:, :, :202], scale, fp8_quant.E4M3, "triton")
  monkeypatch.setattr(quantizers.jax, "default_backend", lambda: "gpu")
  assert fp8_block.resolve(None, 256, 384, elements=w.size) == "xla"  # a kernel that cannot pack: XLA
  assert fp8_block.resolve(None, 256, 384, elements=w.size, packable=True) == "triton"
  assert fp8_quant.resolve(None, w.shape, packable=True) == "triton"
  assert fp8_quant.resolve(None, (3, 256, 202), packable=True) == "xla"


def test_packed_words_hold_four_values_in_order():
  """pack_words / unpack_words against numpy's little-endian view of the same bytes."""
  import jax.numpy as jnp
  import numpy as np

  q = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64)) * 100, jnp.float8_e4m3fn)
  words = quantizers.pack_words(q)
  assert words.shape == (4, 16) and words.dtype == jnp.uint32
  raw = np.asarray(q).view(np.uint8)
  np.testing.assert_array_equal(np.asarray(words), raw.reshape(4, 16, 4).copy().view("<u4")[..., 0])
  np.testing.assert_array_equal(np.asarray(quantizers.unpack_words(words, jnp.float8_e4m3fn)).view(np.uint8), raw)
