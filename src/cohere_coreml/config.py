"""Project-wide defaults, in one place. Values of the *model* (widths, ids) are never here: they
are read from each checkpoint's config and tokenizer."""

from __future__ import annotations

from pathlib import Path

# Checkpoint
DEFAULT_HUB_ID = "CohereLabs/cohere-transcribe-03-2026"
# Where build outputs go by default, relative to the working directory (git-ignored in the checkout).
DEFAULT_OUT_DIR = Path("out")

# Audio window of the exported encoder
SAMPLE_RATE = 16000
DEFAULT_WINDOW_SECONDS = 35.0

# Decoding (upstream defaults)
PROMPT_LENGTH = 10
DEFAULT_MAX_NEW_TOKENS = 256
# Prompt of the decoder export gate, and the other prompt of its "wrong prompt" negative control
# (a language the built-in default model was trained on, the other punctuation mode).
GATE_LANGUAGE = "en"
CONTROL_LANGUAGE = "de"
# Beam search: finished hypotheses ranked by sum(log p) / length ** LENGTH_PENALTY (transformers' default).
LENGTH_PENALTY = 1.0
# Repetition guard (off unless asked for): a tail of >= MIN_REPEATS back-to-back copies of an n-gram
# (n <= MAX_NGRAM) covering >= MIN_SPAN tokens is a decoder loop.
REPETITION_MAX_NGRAM = 8
REPETITION_MIN_REPEATS = 3
REPETITION_MIN_SPAN = 12
# Digital silence: audio whose peak amplitude is below this has nothing to transcribe (an empty
# transcript marked silent, no model call).
SILENCE_PEAK = 1e-4
# Static shapes the Neural Engine likes: encoder memory and KV-cache lengths are multiples of this.
ANE_MULTIPLE = 32
# Additive attention-mask value for masked positions: finite in fp16 (exp(-1e4) == 0), whereas
# finfo(float32).min or -1e9 become -inf in an fp16 program and fully masked rows then give NaN.
FP16_MASK_VALUE = -1e4

# Package format: names written by the exporters (encoder, front end, decoder) and read by bundle/transcribe.
# Metadata key of a length-bucketed encoder: {function: {window_seconds, frames, encoder_frames, padded_frames}}
BUCKETS_METADATA_KEY = "com.cohere_coreml.buckets"
# the host's length-mask rule of an encoder package (shapes.LengthMasks.to_manifest, JSON)
LENGTH_MASKS_METADATA_KEY = "com.cohere_coreml.length_masks"
# an encoder in parts: {"index", "count", "layers": [start, stop], "num_layers"} in each part's package
PART_METADATA_KEY = "com.cohere_coreml.encoder_part"
# Metadata key of the front-end package: {function: {window_seconds, samples, frames}}
FRONTEND_FUNCTIONS_METADATA_KEY = "com.cohere_coreml.functions"
# Functions of decoder.mlpackage (one state layout shared by all of them but STEP_BATCH_FUNCTION, docs/decoder.md):
STEP_FUNCTION = "main"  # one token: input_ids (1, 1), position (1,)
BIND_FUNCTION = "bind_memory"  # once per window: the encoder's cross memory -> the state
PREFILL_FUNCTION = "prefill"  # optional: the whole prompt in one call
# optional: up to EXTEND_LENGTH tokens from a given cache slot in one call (a forced prefix: prompt +
# confirmed tokens of a streaming partial); input_ids (1, K) padded, position (1,), length (1,)
EXTEND_FUNCTION = "extend"
EXTEND_LENGTH = ANE_MULTIPLE  # K: tokens per extend call (the Neural Engine's preferred multiple)
# optional: the cross-attention weights of the alignment heads for a window's decoded tokens (word timings,
# docs/word-timings.md), EXTEND_LENGTH a call: the host-state extend's inputs (input_ids (1, K), position (1,),
# cache_mask (1, 1, 1, C)) over the decoded self cache, output ALIGN_OUTPUT (1, heads, K, Tp) fp16
ALIGN_FUNCTION = "align"
ALIGN_OUTPUT = "cross_attention"
ALIGN_METADATA_KEY = "com.cohere_coreml.alignment"  # decoder package metadata: the alignment block (JSON)
ALIGN_NOTE_METADATA_KEY = "com.cohere_coreml.alignment_note"  # why a decoder package has no align function
ALIGN_REQUEST_METADATA_KEY = "com.cohere_coreml.alignment_request"  # what the export asked (`alignment_request`)
# vad.mlpackage (Silero VAD, docs/bundle.md): its functions, the block of chunks a call and the one-chunk stream
VAD_BLOCK_FUNCTION = "block"  # the default function: frames (N, 576), h, c -> probability (1, N), h_out, c_out
VAD_CHUNK_FUNCTION = "chunk"  # the same with N = 1
VAD_METADATA_KEY = "com.cohere_coreml.vad"  # vad package metadata: source, sizes, chunks per function (JSON)
VAD_REQUEST_METADATA_KEY = "com.cohere_coreml.vad_request"  # what the export asked (`vad_package.vad_request`)
EXTEND_PAD_ID = 0  # fills input_ids past `length`: never read (causal mask), overwritten before it is visible
# The cross memory the encoder outputs and the decoder keeps in its state under the same names;
# bind_memory takes each as input BIND_INPUT_PREFIX + name (a function input cannot share a state's name).
MEMORY_NAMES = ("cross_k", "cross_v", "cross_mask")
BIND_INPUT_PREFIX = "encoder_"
BIND_OUTPUT = "memory_length"  # int32 (1,): valid (unmasked) frames of the memory just bound

# Who writes the decoder's state (`export --decoder-state`, manifest `decoder.state_writes`, docs/decoder.md):
# "graph": the functions write the KV cache at the runtime position and bind_memory writes the memory;
# "host": the functions only read the state and return the new K/V rows, which the host writes (no
# bind_memory: the host writes the cross memory once per window). DECODER_STATE_DEFAULT is the export's.
DECODER_STATE_GRAPH = "graph"
DECODER_STATE_HOST = "host"
DECODER_STATES = (DECODER_STATE_HOST, DECODER_STATE_GRAPH)
DECODER_STATE_DEFAULT = DECODER_STATE_HOST
CACHE_MASK_INPUT = "cache_mask"  # host variant: fp16 (1, 1, 1, C), 0 for filled cache slots, FP16_MASK_VALUE else
NEW_ROWS_OUTPUTS = {"self_k": "new_k", "self_v": "new_v"}  # host variant: state -> output of its new rows
# The batched step of the host-state decoder (`export --decoder-batch B`, manifest `decoder.batch`, docs/decoder.md):
# one token for each of B windows a call, each row its own token, position, cache mask and cross memory; a state of
# its own (`DecoderShapes.batch_state_shapes`). B = 1: no batched function (the graph variant always).
STEP_BATCH_FUNCTION = "step_batch"
DECODER_BATCH_DEFAULT = 4

def round_up(n: int, multiple: int = ANE_MULTIPLE) -> int:
    return -(-int(n) // multiple) * multiple

# Gate verdicts on argmax disagreements (parity.argmax_flips): a step whose greedy token differs from the
# reference refuses only when the reference's margin between the two tokens exceeds NEAR_TIE_FACTOR x the
# error measured at that step on the reference's other top-NEAR_TIE_TOP_K tokens; closer flips are
# near-ties (counted, reported, not fatal: a random model or a real checkpoint's EOS ties).
NEAR_TIE_TOP_K = 16
NEAR_TIE_FACTOR = 2.0
