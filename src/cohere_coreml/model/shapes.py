"""Static shapes of the exported programs, in one place.

Every size the packages fix is computed here, from the checkpoint's config and front end:

    window samples  S  = window seconds * sample rate                 (35 s -> 560000)
    window frames   F  = samples of the window // hop                 (35 s -> 3500)
    encoder frames  T  = the encoder's own subsampling arithmetic(F)  (3500 -> 438)
    memory length   Tp = round_up(T, 32), or a given length (buckets) (438 -> 448)
    cache capacity  C  = round_up(prompt + max new tokens, 32)        (10 + 256 -> 288)
    buckets            shorter windows whose memory is padded to the full window's Tp

`export_plan` gathers them for one export (encoder functions, the front-end functions of the same
windows, decoder), so the component modules receive their sizes and never compute each other's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..config import ANE_MULTIPLE, DEFAULT_MAX_NEW_TOKENS, PROMPT_LENGTH, round_up
from .audio import FrontEndConfig


class ShapeError(ValueError):
    """A window, length or capacity that the exported programs cannot have."""


class WindowTooLongError(ShapeError):
    """A window with more mel frames than any encoder function (length bucket) holds."""


# --------------------------------------------------------------------------------------------
# Single facts
# --------------------------------------------------------------------------------------------


def window_samples(window_seconds: float, sample_rate: int) -> int:
    """Audio samples of a window (35 s at 16 kHz -> 560000)."""
    return int(round(float(window_seconds) * sample_rate))


def window_frames(window_seconds: float, sample_rate: int, hop_length: int) -> int:
    """Mel frames of a window, as `CohereAsrFeatureExtractor` counts them for a full window.

    valid frames = (samples + 2 * (n_fft // 2) - n_fft) // hop = samples // hop (n_fft even).
    35 s at 16 kHz, hop 160 -> 3500.
    """
    samples = window_samples(window_seconds, sample_rate)
    frames = samples // hop_length
    if frames < 1:
        raise ShapeError(
            f"window of {window_seconds} s is shorter than one mel frame (hop {hop_length} at {sample_rate} Hz)"
        )
    return frames


def encoder_frames(model, frames):
    """Encoder frames for `frames` mel frames (int -> int, tensor/array -> int32 tensor), with
    transformers' own subsampling arithmetic."""
    import torch  # heavy: only where a PyTorch model is measured (shapes loads without torch)

    lengths = torch.as_tensor(frames).reshape(-1)
    out = model.model.encoder._get_subsampling_output_length(lengths).to(torch.int32)
    return int(out[0]) if isinstance(frames, int) else out


def memory_len(n_encoder_frames: int) -> int:
    """Tp: encoder frames rounded up to a multiple of 32 (448 for 438)."""
    return round_up(n_encoder_frames, ANE_MULTIPLE)


def cache_capacity(max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, prompt_len: int = PROMPT_LENGTH) -> int:
    """Cache slots: prompt + new tokens, rounded up to a multiple of 32 (288 for 10 + 256)."""
    if max_new_tokens < 1:
        raise ShapeError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return round_up(prompt_len + max_new_tokens, ANE_MULTIPLE)


def bucket_function_name(window_seconds: float) -> str:
    """Function name of a length bucket in a multifunction encoder (10 s -> window_10s)."""
    return "window_" + f"{window_seconds:g}".replace(".", "_") + "s"


def choose_bucket(buckets: dict[str, int], n_frames: int) -> str:
    """The encoder function ({name: window frames}, any order) with the smallest window that holds
    `n_frames` valid mel frames (equal sizes: the first name in sort order).

    The one bucket chooser: the `Transcriber` and the Swift fixtures use it. Raises
    `WindowTooLongError` when no window holds the frames (never a silent fallback to "main")."""
    if not buckets:
        raise ShapeError("the encoder lists no function (no window to choose from)")
    fitting = [(int(frames), fn) for fn, frames in buckets.items() if int(frames) >= n_frames]
    if not fitting:
        raise WindowTooLongError(f"{n_frames} mel frames do not fit any encoder window "
                                 f"{sorted(int(f) for f in buckets.values())}: split the audio first "
                                 "(audio.split_long_audio)")
    return min(fitting)[1]


def choose_frontend_function(functions: dict[str, dict], num_samples: int, min_frames: int = 0) -> str:
    """The front-end function ({name: {"samples", "frames"}}) with the smallest window that holds
    `num_samples` samples and gives at least `min_frames` mel frames."""
    fitting = [(int(v["samples"]), fn) for fn, v in functions.items()
               if int(v["samples"]) >= num_samples and int(v["frames"]) >= min_frames]
    if not fitting:
        longest = max(int(v["samples"]) for v in functions.values())
        raise ShapeError(f"clip has {num_samples} samples but the longest front-end window holds {longest}: "
                         "split it with split_long_audio")
    return min(fitting)[1]


# --------------------------------------------------------------------------------------------
# Front end (frontend.mlpackage: samples -> the encoder's input_features)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FrontEndShapes:
    """Sizes of one front-end function (one window)."""

    window_seconds: float
    samples: int  # S, audio samples of the window
    frames: int  # F = S // hop, mel frames (the encoder function's input frames)
    n_mels: int  # M
    n_fft: int
    win_length: int
    hop_length: int
    sample_rate: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def frontend_shapes(front_end, window_seconds: float) -> FrontEndShapes:
    """Shapes of the front end for one window; `front_end` is an `audio.FrontEndConfig`.

    F is `window_frames` of the window, the encoder function's frames for the same window.
    """
    samples = window_samples(window_seconds, front_end.sampling_rate)
    frames = window_frames(window_seconds, front_end.sampling_rate, front_end.hop_length)
    if frames < 2:
        raise ShapeError(f"a window of {window_seconds} s holds {frames} mel frame(s); at least 2 are needed")
    if front_end.win_length > front_end.n_fft:
        raise ShapeError(f"win_length {front_end.win_length} > n_fft {front_end.n_fft}")
    return FrontEndShapes(window_seconds=float(window_seconds), samples=samples, frames=frames,
                          n_mels=int(front_end.n_mels), n_fft=int(front_end.n_fft),
                          win_length=int(front_end.win_length), hop_length=int(front_end.hop_length),
                          sample_rate=int(front_end.sampling_rate))


# --------------------------------------------------------------------------------------------
# Encoder
# --------------------------------------------------------------------------------------------


# Names of the encoder's length-mask inputs (fp16, 1 = valid frame, 0 = padding), one per time
# resolution: the mel frames, each subsampling stage but the last, then the encoder frames.
FEATURE_MASK = "feature_mask"
SUBSAMPLING_MASK_PREFIX = "subsampling_mask_"
ENCODER_MASK = "encoder_mask"


@dataclass(frozen=True)
class LengthMasks:
    """The encoder's length masks: what the host computes from a window's valid mel frames.

    The exported encoder computes no length arithmetic (int/fp32/bool ops keep a program off the
    Neural Engine; docs/ane.md); the host passes one fp16 0/1 mask per time resolution instead:

        feature_mask         (1, F)    frames < n                   (the mel frames)
        subsampling_mask_k   (1, T_k)  frames < L_k, k = 1..S-1     (after stride convolution k)
        encoder_mask         (1, T)    frames < L_S                 (the encoder frames, T = T_S)

    with L_0 = n and L_k = (L_{k-1} + 2 * padding - kernel) // stride + 1, transformers' arithmetic
    (`ParakeetEncoderSubsamplingConv2D._get_output_length` for each stage,
    `ParakeetPreTrainedModel._get_subsampling_output_length` for the encoder frames: the same numbers
    for integer lengths, checked against the model by `encoder_shapes`). L_S is the window's
    `encoder_length`. `frames` are the masks' sizes for one window, (F, T_1, ..., T_S), by the same
    rule applied to F. The manifest carries `kernel_size`, `stride`, `padding` and `stages`
    (`to_manifest`); the Swift package and the bundle's example compute the same masks from them.
    """

    kernel_size: int
    stride: int
    padding: int
    stages: int  # S, stride convolutions (log2 of the subsampling factor)

    @classmethod
    def from_config(cls, encoder_config) -> LengthMasks:
        factor = int(encoder_config.subsampling_factor)
        stages = factor.bit_length() - 1
        if factor < 1 or 2 ** stages != factor:
            raise ShapeError(f"subsampling factor {factor} is not a power of two")
        kernel = int(encoder_config.subsampling_conv_kernel_size)
        return cls(kernel_size=kernel, stride=int(encoder_config.subsampling_conv_stride),
                   padding=(kernel - 1) // 2, stages=stages)

    @classmethod
    def from_manifest(cls, block: dict) -> LengthMasks:
        return cls(**{k: int(block[k]) for k in ("kernel_size", "stride", "padding", "stages")})

    def to_manifest(self) -> dict[str, int]:
        return asdict(self)

    @property
    def names(self) -> tuple[str, ...]:
        """Input names, mel frames first, encoder frames last."""
        return (FEATURE_MASK, *(f"{SUBSAMPLING_MASK_PREFIX}{k}" for k in range(1, self.stages)), ENCODER_MASK)

    def lengths(self, n: int) -> list[int]:
        """[L_0 = n, L_1, ..., L_S]: valid frames at each resolution (L_S: the encoder_length)."""
        out = [int(n)]
        for _ in range(self.stages):
            out.append((out[-1] + 2 * self.padding - self.kernel_size) // self.stride + 1)
        return out

    def frames(self, window_frames: int) -> list[int]:
        """The masks' sizes for a window of F mel frames: (F, T_1, ..., T_S)."""
        return self.lengths(window_frames)

    def inputs(self, n_valid: int, window_frames: int) -> dict[str, np.ndarray]:
        """{name: (1, frames) float16 0/1 mask} for `n_valid` valid mel frames of a window of F."""
        n = int(n_valid)
        if not 1 <= n <= window_frames:
            raise ShapeError(f"{n} valid mel frames do not fit an encoder window of {window_frames} (1..{window_frames})")
        masks = {}
        for name, frames, valid in zip(self.names, self.frames(window_frames), self.lengths(n)):
            mask = np.zeros((1, frames), dtype=np.float16)
            mask[0, : max(0, min(valid, frames))] = 1.0
            masks[name] = mask
        return masks

    def encoder_length(self, n_valid: int) -> int:
        return self.lengths(n_valid)[-1]


@dataclass(frozen=True)
class EncoderShapes:
    """All sizes of the exported encoder, read from the model config and the front end."""

    n_mels: int  # M
    frames: int  # F, mel frames of one window
    encoder_frames: int  # T, encoder frames for F frames
    padded_frames: int  # Tp, T rounded up to ANE_MULTIPLE (or the full window's Tp for a bucket)
    encoder_hidden_size: int
    decoder_hidden_size: int  # Ddec
    num_layers: int  # L (decoder layers)
    num_kv_heads: int  # Hkv
    head_dim: int  # Dh
    sample_rate: int
    hop_length: int
    window_seconds: float
    masks: LengthMasks  # the length-mask inputs (host arithmetic)
    encoder_layers: int  # conformer layers

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def mask_frames(self) -> list[int]:
        """Sizes of the length masks (F, T_1, ..., T_S = T)."""
        return self.masks.frames(self.frames)


def encoder_shapes(model, window_seconds: float, processor=None, frames: int | None = None,
                   memory_frames: int | None = None) -> EncoderShapes:
    """Shapes of the exported encoder for a window.

    `memory_frames` (length buckets): pad the memory to this many frames instead of
    round_up(T, 32), so a shorter window's outputs have the full window's shapes.
    """
    config = model.config
    enc = config.encoder_config
    front_end = FrontEndConfig.from_processor(processor) if processor is not None else FrontEndConfig()
    if frames is None:
        frames = window_frames(window_seconds, front_end.sampling_rate, front_end.hop_length)
    t = encoder_frames(model, int(frames))
    if t < 1:
        raise ShapeError(f"a window of {frames} mel frames gives no encoder frame")
    masks = LengthMasks.from_config(enc)
    if masks.frames(int(frames))[-1] != t:
        raise ShapeError(f"the host length-mask arithmetic gives {masks.frames(int(frames))[-1]} encoder frames for "
                         f"{frames} mel frames, transformers {t}: this subsampling is not supported")
    padded = memory_len(t) if memory_frames is None else int(memory_frames)
    if padded < t:
        raise ShapeError(f"memory of {padded} frames cannot hold the {t} encoder frames of {frames} mel frames")
    return EncoderShapes(
        n_mels=int(enc.num_mel_bins),
        frames=int(frames),
        encoder_frames=t,
        padded_frames=padded,
        encoder_hidden_size=int(enc.hidden_size),
        decoder_hidden_size=int(config.hidden_size),
        num_layers=int(config.num_hidden_layers),
        num_kv_heads=int(config.num_key_value_heads),
        head_dim=int(config.head_dim),
        sample_rate=front_end.sampling_rate,
        hop_length=front_end.hop_length,
        window_seconds=float(window_seconds),
        masks=masks,
        encoder_layers=int(enc.num_hidden_layers),
    )


def bucket_shapes(model, window_seconds: float, bucket_seconds=(), processor=None) -> dict[str, EncoderShapes]:
    """{function: EncoderShapes} of an encoder with length buckets: `main` is the full window, each
    shorter bucket a function `window_<s>s` whose memory is padded to main's Tp."""
    full = encoder_shapes(model, window_seconds, processor)
    buckets = sorted({float(b) for b in bucket_seconds if float(b) != float(window_seconds)})
    too_long = [b for b in buckets if b > window_seconds]
    if too_long:
        raise ShapeError(f"bucket(s) {too_long} s are longer than the window ({window_seconds} s)")
    shapes = {"main": full}
    for seconds in buckets:
        shapes[bucket_function_name(seconds)] = encoder_shapes(model, seconds, processor,
                                                               memory_frames=full.padded_frames)
    return shapes


# --------------------------------------------------------------------------------------------
# Decoder
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecoderShapes:
    """Static shapes of the decode-step program, all read from the checkpoint config."""

    num_layers: int  # L
    num_heads: int  # H (query heads)
    num_kv_heads: int  # Hkv
    head_dim: int  # Dh
    hidden_size: int  # Ddec
    vocab_size: int  # V
    capacity: int  # C (self-attention cache slots)
    memory_len: int  # Tp (padded encoder frames)
    max_positions: int  # decoder position table size

    @classmethod
    def from_config(cls, config, capacity: int, memory_len: int) -> DecoderShapes:
        shapes = cls(
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            capacity=int(capacity),
            memory_len=int(memory_len),
            max_positions=config.max_position_embeddings,
        )
        if shapes.capacity > shapes.max_positions:
            raise ShapeError(
                f"cache capacity {shapes.capacity} exceeds the decoder's position table "
                f"({shapes.max_positions} positions); lower --max-tokens"
            )
        return shapes

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_kv_heads, self.capacity, self.head_dim)

    @property
    def memory_shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_kv_heads, self.memory_len, self.head_dim)

    def batch_state_shapes(self, batch: int) -> dict[str, tuple[int, int, int, int]]:
        """The batched step's states (`step_batch`, docs/decoder.md): B windows folded into the head axis, row b
        holding heads b*Hkv .. (b+1)*Hkv-1 (rank 4, as the Neural Engine needs), each row its own cache, memory
        and cross mask."""
        b = int(batch)
        cache = (self.num_layers, b * self.num_kv_heads, self.capacity, self.head_dim)
        memory = (self.num_layers, b * self.num_kv_heads, self.memory_len, self.head_dim)
        return {"self_k": cache, "self_v": cache, "cross_k": memory, "cross_v": memory,
                "cross_mask": (b, 1, 1, self.memory_len)}

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# One export
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportPlan:
    """Every static shape of one export: encoder functions, the front-end functions of the same
    windows, and the decoder that reads the encoder's memory."""

    encoder: dict[str, EncoderShapes]  # function name -> shapes; "main" is the full window
    decoder: DecoderShapes
    prompt_len: int
    frontend: dict[str, FrontEndShapes]  # the encoder's function names and windows

    @property
    def window(self) -> EncoderShapes:
        return self.encoder["main"]


def export_plan(model, processor, window_seconds: float, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                prompt_len: int = PROMPT_LENGTH, bucket_seconds=()) -> ExportPlan:
    """Shapes of an export: the decoder's memory length is the full window's padded encoder frames;
    the front end has one function per encoder function (same name, same window)."""
    encoder = bucket_shapes(model, window_seconds, bucket_seconds, processor)
    capacity = cache_capacity(max_new_tokens, prompt_len)
    decoder = DecoderShapes.from_config(model.config, capacity, encoder["main"].padded_frames)
    front_end = FrontEndConfig.from_processor(processor, dither=0.0) if processor is not None else FrontEndConfig()
    frontend = {fn: frontend_shapes(front_end, shapes.window_seconds) for fn, shapes in encoder.items()}
    return ExportPlan(encoder=encoder, decoder=decoder, prompt_len=int(prompt_len), frontend=frontend)
