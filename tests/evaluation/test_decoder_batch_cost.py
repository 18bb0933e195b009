"""evaluation.decoder_batch_cost (tools/bench/bench_decoder_batch.py's figures): the two weight counts (a config's
parameters, a package's program) agree, a batched call reads the step's weights once for B tokens, and the
state arithmetic equals the batched step's declared states."""

from __future__ import annotations

import numpy as np

from cohere_coreml.bundle.load import Bundle
from cohere_coreml.evaluation import decoder_batch_cost as cost
from cohere_coreml.model.shapes import DecoderShapes


def test_program_and_parameter_counts_agree(trained_reference, trained_bundle):
    model, _ = trained_reference
    params = cost.decoder_step_parameters(model)
    program = cost.program_step_weights(trained_bundle / "decoder.mlpackage", "main")
    batched = cost.program_step_weights(trained_bundle / "decoder.mlpackage", "step_batch")
    assert batched == program  # the batched step reads the same weights (shared blobs)
    # fp16: the lookup tables and their rows exactly; the weights read whole, but for the small tensors (norms,
    # biases) the converter keeps inline in the program rather than in the weight file
    assert program["tables"] == 2 * params["tables"] and program["per_token"] == 2 * params["per_token"]
    assert 0.9 * 2 * params["read"] <= program["read"] <= 2 * params["read"]
    per_token = [cost.weight_bytes_per_token(program, b, 1) for b in (1, 2, 4)]
    assert per_token[0] == program["read"] + program["per_token"]
    assert np.allclose(per_token[1:], [program["read"] / 2 + program["per_token"], program["read"] / 4
                                       + program["per_token"]])


def test_state_bytes_are_the_batched_steps_states(trained_reference, trained_bundle):
    dec = Bundle.load(trained_bundle).manifest["decoder"]
    b = dec["batch"]["size"]
    shapes = DecoderShapes.from_config(trained_reference[0].config, dec["capacity"], dec["memory_shape"][2])
    declared = sum(2 * int(np.prod(s["shape"])) for s in dec["batch"]["io"]["states"].values())
    figures = cost.memory_figures(shapes, b)
    assert figures["state"] == declared and figures["state_per_row"] * b == declared
    step = sum(2 * int(np.prod(s["shape"])) for s in dec["io"]["states"].values())
    assert cost.memory_figures(shapes, 1)["state"] == step  # one row: the step's own state
