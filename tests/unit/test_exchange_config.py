"""The exchange's config keys (te_moe_exchange=hier, te_moe_ep_node_size, te_moe_chunks): refused while
the config is built, in one error naming what fits; accepted values reach the MoE context."""

from __future__ import annotations

import types

import pydantic
import pytest

from conftest import maxtext_config
from temoe import cli

CASES = {
    "unknown exchange": (["te_moe_exchange=deepep"], "valid choices: auto, ragged, padded, dedup, hier"),
    "node size zero": (["te_moe_exchange=hier", "te_moe_ep_node_size=0"], "ranks per node along the expert axis"),
    "node size not a number": (["te_moe_exchange=hier", "te_moe_ep_node_size=eight"], "an integer"),
    "node size without hier": (["te_moe_ep_node_size=4"], "set te_moe_exchange=hier or leave it at 8"),
    "node straddles slices": (["te_moe_exchange=hier", "te_moe_ep_node_size=3", "ici_expert_parallelism=4",
                               "ici_fsdp_parallelism=1"], "choose a divisor of 4"),
    "node is not the slice": (["te_moe_exchange=hier", "te_moe_ep_node_size=2", "ici_expert_parallelism=4",
                               "dcn_expert_parallelism=2", "num_slices=2"], "set te_moe_ep_node_size=4"),
    "chunks zero": (["te_moe_chunks=0"], "an integer >= 1 (1: unchunked)"),
    "chunks without temoe's block": (["te_moe_chunks=2", "te_moe_block=false"], "need te_moe_block=true"),
    "hier without temoe's block": (["te_moe_exchange=hier", "te_moe_block=false"], "need te_moe_block=true"),
    "pipeline with a routing bias": (["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=1"],
                                     "MaxText's pipeline carries no MoE routing-bias variable"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_exchange_settings_are_refused_in_one_line(case):
  overrides, expected = CASES[case]
  with pytest.raises(pydantic.ValidationError) as info:
    maxtext_config(*overrides)
  message = cli.config_error_message(info.value)
  assert len(info.value.errors()) == 1 and "\n" not in message.strip() and expected in message, message


def test_accepted_settings_reach_the_moe_context(monkeypatch):
  from temoe.maxtext import adapter  # pylint: disable=import-outside-toplevel

  cfg = maxtext_config("te_moe_exchange=hier", "te_moe_ep_node_size=2", "te_moe_chunks=4", "ici_expert_parallelism=4",
                       "ici_fsdp_parallelism=1")
  assert (cfg.te_moe_exchange, cfg.te_moe_ep_node_size, cfg.te_moe_chunks) == ("hier", 2, 4)
  monkeypatch.setattr(adapter, "kernel_for", lambda cfg: "xla")
  layer = types.SimpleNamespace(
      config=cfg, mesh=None, num_experts=8, num_experts_per_tok=2, dtype="float32", apply_ffn_activation=None,
      _expert_parallelism_name="expert", get_expert_parallelism_size=lambda: 1, _logical_to_mesh_axes=None)
  ctx = adapter.context(layer)
  assert (ctx.exchange, ctx.ep_node_size, ctx.chunks) == ("hier", 2, 4)
