"""Schemes, recipes, presets (`cohere_coreml.quantize.recipes`)."""

from __future__ import annotations

import pytest

from cohere_coreml.quantize import recipes


def test_presets_and_skip_reasons():
    q8 = recipes.preset_recipes("q8")
    assert (q8["encoder"].scheme, q8["decoder"].scheme) == ("int8", "int8")
    assert recipes.preset_recipes("q8-hybrid")["decoder"].scheme is None
    # the LM head stays fp16 in every preset that compresses the decoder; other weights do not
    for preset in ("q8", "q4"):
        dec = recipes.PRESETS[preset]["decoder"]
        assert "recipe" in dec.skip_reason("proj_out_weight_to_fp16", ["linear"])
        assert dec.skip_reason("layers_0_self_attn_q_proj_weight_to_fp16", ["linear"]) is None
    kept = recipes.Recipe("int8", skip_op_types=("gather",), keep_fp16=("w1",))
    assert "--target-psnr" in kept.skip_reason("w1", [])
    assert "'gather'" in kept.skip_reason("emb", ["gather", "linear"])
    assert kept.to_dict()["keep_fp16"] == ["w1"] and kept.to_dict()["description"] == recipes.SCHEMES["int8"]
    with pytest.raises(recipes.QuantizeError, match="unknown preset"):
        recipes.preset_recipes("q2")
    with pytest.raises(recipes.QuantizeError, match="unknown scheme"):
        recipes.scheme_config("pal1")
    assert set(recipes.GATES) == set(recipes.PRESETS) - {"f16"}
