"""The classification of MaxText's MoE-affecting config keys (temoe.maxtext.moe_keys).

Fails when MaxText's schema (or what its MoE layer reads) grows a key, or its decoder blocks a
family, that the table does not classify; checks that every supported entry names a parity case
of the matrix and that every refused entry is refused while the config is built.
"""

from __future__ import annotations

import pydantic
import pytest

from conftest import maxtext_config
from parity_check import CASES, megatron_seam
from temoe.maxtext import moe_keys


def test_every_maxtext_moe_key_is_classified():
  keys = moe_keys.maxtext_moe_keys()
  assert not keys - set(moe_keys.KEYS), f"classify these MaxText MoE keys in moe_keys.KEYS: {sorted(keys - set(moe_keys.KEYS))}"
  assert not set(moe_keys.KEYS) - keys, f"no longer MaxText MoE keys: {sorted(set(moe_keys.KEYS) - keys)}"


def test_every_decoder_block_is_classified():
  assert set(moe_keys.DECODER_BLOCKS) == moe_keys.maxtext_decoder_blocks()


def test_the_read_rule_sees_config_reads():
  source = "def f(self, cfg, config):\n  self.config.num_experts; cfg.dtype; getattr(config, 'megablox', 1); other.emb_dim\n"
  assert moe_keys.config_reads(source, {"num_experts", "dtype", "megablox", "emb_dim"}) == {
      "num_experts", "dtype", "megablox"}


TABLE = {**{f"key {k}": v for k, v in moe_keys.KEYS.items()},
         **{f"decoder_block {k}": v for k, v in moe_keys.DECODER_BLOCKS.items()}}


@pytest.mark.parametrize("name", sorted(TABLE))
def test_entry_is_complete(name):
  entry = TABLE[name]
  assert entry.status in (moe_keys.SUPPORTED, moe_keys.REFUSED, moe_keys.IRRELEVANT) and entry.reason, name
  if entry.status == moe_keys.SUPPORTED:
    assert entry.case in CASES, (name, entry.case)
  if entry.status == moe_keys.REFUSED:
    assert entry.refuse and entry.message, name


@pytest.mark.parametrize("name", sorted(n for n, e in TABLE.items() if e.status == moe_keys.REFUSED))
def test_refused_entry_is_refused_before_compile(name):
  entry = TABLE[name]
  with pytest.raises(pydantic.ValidationError) as info:
    maxtext_config(*entry.refuse)
  assert len(info.value.errors()) == 1 and entry.message in str(info.value), str(info.value)
  maxtext_config(*entry.refuse, "te_moe_block=false")  # native accepts it: the refusal is temoe's block's


def test_megatron_seq_aux_loss_is_summed_over_layers_as_native_or_refused():
  """The block computes MaxText's Megatron seq aux loss (parity case deepseek3_megatron_aux_grad_accum);
  the train step sums it over layers only where `uses_megatron_seq_aux_loss` says so for te_moe_block."""
  from maxtext.layers import moe  # pylint: disable=import-outside-toplevel

  flag = ("moe_use_megatron_seq_aux_loss=true", "load_balance_loss_weight=0.001")
  assert moe.uses_megatron_seq_aux_loss(maxtext_config(*flag, "te_moe_block=false"))
  with megatron_seam():
    assert moe.uses_megatron_seq_aux_loss(maxtext_config(*flag))
  try:
    cfg = maxtext_config(*flag)
  except pydantic.ValidationError as exc:  # the seam is not installed: refused, naming the flag
    assert len(exc.errors()) == 1 and "moe_use_megatron_seq_aux_loss=true" in str(exc), str(exc)
  else:  # accepted only where the train step sums the loss as it does for native
    assert moe.uses_megatron_seq_aux_loss(cfg)
