"""The reference with its encoder layers read from the checkpoint while they are used (`load_streamed_reference`).

The encoder's layers hold nine tenths of Cohere Transcribe's parameters; in float32 the whole reference
takes twice the bytes of the bf16 checkpoint, more than a 16 GB Mac can spare next to a conversion. An
export only ever needs some of those layers at once: the layers of the encoder part it converts, or the
one layer a reference forward pass is running. So the model is built by `transformers` with every
weight but the encoder layers' (`from_pretrained` with a configuration of no encoder layers: its
loader, key renaming and buffers as usual), and the layers, transformers' own modules, are built on the
`meta` device (no storage) and given their tensors from the checkpoint's safetensors files when needed:

* in a forward pass, a layer reads its tensors just before it runs and drops them after (hooks);
* `LayerStream.resident(start, stop)` keeps layers [start, stop) read for the time of a block (tracing a
  part of the encoder: the traced program keeps the tensors it holds after the block ends).

The tensors are the checkpoint's, cast to float32 as `checkpoint.load_reference` casts them, so every
output is the loaded model's, bit for bit (tests/model/test_layer_stream.py). Which checkpoint key
fills which parameter is transformers' own renaming (the one `from_pretrained` applied to the other
keys), checked to be one to one, shape for shape, and to keep each key's layer index.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .checkpoint import CheckpointError, check_checkpoint_dir, resolve_checkpoint, safetensors_file_shapes

logger = logging.getLogger(__name__)

LAYERS_PREFIX = "model.encoder.layers."  # the streamed modules' names in the loaded model
_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class LayerStream:
    """The encoder layers of a model, built on the meta device, read from safetensors files when used.

    `sources[i]`: for layer i, its tensors' names within the layer -> (safetensors file, key in it).
    Forward hooks read a layer before it runs and release it after, unless it is held resident.
    """

    def __init__(self, layers, sources: list[dict[str, tuple[Path, str]]], dtype):
        self.layers = layers
        self.sources = sources
        self.dtype = dtype
        self._held = [0] * len(layers)  # resident() blocks holding the layer
        self._running = [0] * len(layers)  # forward calls in progress
        self._read = [False] * len(layers)
        self.reads = 0  # layers read from the files so far (how often the stream paid a read)
        self._handles = []
        self._group: _LockStep | None = None  # the calls of `together`, while they run
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(lambda _m, _a, i=i: self._enter(i)))
            self._handles.append(layer.register_forward_hook(lambda _m, _a, _o, i=i: self._leave(i), always_call=True))

    def __len__(self) -> int:
        return len(self.layers)

    def _enter(self, i: int) -> None:
        group = self._group
        if group is not None and group.member():
            group.enter(i)
            return
        self._running[i] += 1
        if not self._read[i]:
            self._load([i])

    def _leave(self, i: int) -> None:
        group = self._group
        if group is not None and group.member():
            group.leave(i)
            return
        self._running[i] -= 1
        self._maybe_release(i)

    def together(self, calls: Sequence[Callable[[], Any]]) -> list:
        """The results of `calls`, each at most one forward pass through the encoder layers, run in threads in
        lock step: layer i is read once, when every call still running waits to enter it, and released when
        they have all left it. So N passes read each layer once instead of N times; each pass computes what it
        computes alone (its own tensors, shapes and thread settings). The first exception is raised."""
        import threading

        import torch

        if len(calls) <= 1 or self._group is not None:
            return [call() for call in calls]
        group = _LockStep(self, len(calls), running=max(1, torch.get_num_threads()))
        results: list = [None] * len(calls)
        errors: list[BaseException] = []
        grad, threads = torch.is_grad_enabled(), torch.get_num_threads()

        def run(k: int) -> None:
            group.join()
            group.slots.acquire()
            try:
                torch.set_num_threads(threads)  # as the caller's passes (intra-op splits, hence the sums)
                with torch.set_grad_enabled(grad):  # grad mode is per thread
                    results[k] = calls[k]()
            except BaseException as err:  # noqa: BLE001 - raised in the caller below
                errors.append(err)
            finally:
                group.finish()

        self._group = group
        try:
            workers = [threading.Thread(target=run, args=(k,), name=f"layer-stream-{k}") for k in range(len(calls))]
            for worker in workers:
                worker.start()
            group.serve()  # this thread reads the layers (see `_LockStep.serve`)
            for worker in workers:
                worker.join()
        finally:
            self._group = None
        if errors:
            raise errors[0]
        return results

    def _maybe_release(self, i: int) -> None:
        if self._read[i] and not self._held[i] and not self._running[i]:
            self._release(i)

    @contextlib.contextmanager
    def resident(self, start: int = 0, stop: int | None = None):
        """Within: layers [start, stop) read and kept (released on exit unless something else holds them)."""
        indices = range(start, len(self) if stop is None else stop)
        for i in indices:
            self._held[i] += 1
        try:
            self._load([i for i in indices if not self._read[i]])
            yield
        finally:
            for i in indices:
                self._held[i] -= 1
                self._maybe_release(i)

    def _load(self, indices) -> None:
        """Read the tensors of layers `indices`, one pass over each file they are in."""
        from safetensors import safe_open

        by_file: dict[Path, list[tuple[int, str, str]]] = defaultdict(list)
        for i in indices:
            for name, (file, key) in self.sources[i].items():
                by_file[file].append((i, name, key))
        for file, entries in by_file.items():
            with safe_open(str(file), framework="pt") as f:  # closed (unmapped) after the read
                for i, name, key in entries:
                    tensor = f.get_tensor(key)  # a copy owned by this process (cast: as from_pretrained casts)
                    _assign(self.layers[i], name, tensor.to(self.dtype) if tensor.is_floating_point() else tensor)
        for i in indices:
            self._read[i] = True
            self.reads += 1

    def _release(self, i: int) -> None:
        """Layer i's tensors back to the meta device (their memory is freed once nothing else holds them)."""
        import torch

        for name, _ in self.sources[i].items():
            module, attr = _owner(self.layers[i], name)
            current = getattr(module, attr)
            _assign(self.layers[i], name, torch.empty_like(current, device="meta"))
        self._read[i] = False
        _trim_heap()

    def resident_layers(self) -> list[int]:
        return [i for i, read in enumerate(self._read) if read]

    def close(self) -> None:
        """Remove the hooks (the layers stay as they are: read or on the meta device)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class _LockStep:
    """The bookkeeping of `LayerStream.together`: how many calls wait at, ran and left each layer."""

    def __init__(self, stream: LayerStream, calls: int, running: int):
        import threading

        self.stream = stream
        self.calls = calls
        # calls computing at once (the others wait for a slot, or at a layer): their activations are what the
        # lock step adds to memory, so at most `running` of them (the caller's threads: the CPU is as busy)
        self.slots = threading.Semaphore(running)
        self.finished = 0
        n = len(stream)
        self.waiting, self.left, self.loaded = [0] * n, [0] * n, [False] * n
        self.cond = threading.Condition()
        self._local = threading.local()

    def join(self) -> None:
        self._local.last = -1

    def member(self) -> bool:
        return hasattr(self._local, "last")

    def enter(self, i: int) -> None:
        with self.cond:
            if i <= self._local.last:
                raise RuntimeError("a call of LayerStream.together ran the encoder layers twice (one pass per call)")
            self._local.last = i
            self.waiting[i] += 1
            self.cond.notify_all()  # the reader (`serve`) may read layer i now
            self.slots.release()  # waiting: another call may compute meanwhile
            while not self.loaded[i]:
                self.cond.wait()
        self.slots.acquire()

    def leave(self, i: int) -> None:
        with self.cond:
            self.left[i] += 1
            self._release_passed(i)

    def finish(self) -> None:
        self.slots.release()
        with self.cond:
            self.finished += 1
            self.cond.notify_all()

    def serve(self) -> None:
        """In the caller's thread, until every call finished: read the next layer once every call still running
        waits at it. One thread reads every layer, so that glibc serves the layers' memory from one arena (its
        per-thread arenas keep what a freed layer left for their own thread only: reading in whichever call
        arrives last grew the heap by most of a layer per layer at full size)."""
        stream = self.stream
        with self.cond:
            while self.finished < self.calls:
                waited = [i for i, n in enumerate(self.waiting) if n and not self.loaded[i]]
                if not waited or self.waiting[waited[0]] + self.finished < self.calls:
                    self.cond.wait()
                    continue
                i = waited[0]
                stream._held[i] += 1  # noqa: SLF001 - the stream's own bookkeeping, from its helper
                if not stream._read[i]:  # noqa: SLF001
                    stream._load([i])  # noqa: SLF001
                self.loaded[i] = True
                self.cond.notify_all()

    def _release_passed(self, i: int) -> None:
        if self.loaded[i] and self.left[i] == self.waiting[i]:  # every call that entered it left: none will again
            stream = self.stream
            stream._held[i] -= 1  # noqa: SLF001
            stream._maybe_release(i)  # noqa: SLF001


def run_together(model, calls: Sequence[Callable[[], Any]]) -> list:
    """`LayerStream.together` for a streamed model (each call at most one encoder pass); the calls one after
    another for a model loaded whole."""
    stream = getattr(model, "layer_stream", None)
    return [call() for call in calls] if stream is None else stream.together(calls)


def _owner(root, name: str):
    *path, attr = name.split(".")
    module = root
    for part in path:
        module = getattr(module, part)
    return module, attr


def _assign(root, name: str, tensor) -> None:
    """Set parameter or buffer `name` of `root` to `tensor` (a parameter stays a parameter)."""
    import torch

    module, attr = _owner(root, name)
    if attr in module._parameters:
        old = module._parameters[attr]
        module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=old.requires_grad)
    elif attr in module._buffers:
        module._buffers[attr] = tensor
    else:
        raise KeyError(f"{name} is neither a parameter nor a buffer of {type(root).__name__}")


def layer_sources(model, folder: Path, shapes: dict[str, list[int]], files: dict[str, Path],
                  num_layers: int) -> list[dict[str, tuple[Path, str]]]:
    """For each encoder layer, its tensors' names within the layer -> (file, checkpoint key): transformers'
    renaming of the checkpoint's keys (`core_model_loading.rename_source_key`, with the conversions
    `from_pretrained` used for this model), checked one to one against the layers' parameters and
    buffers, shape for shape, each key in the layer its own index names. CheckpointError otherwise."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = getattr(model, "_weight_conversions", None) or []
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    layers = model.model.encoder.layers
    wanted = {f"{LAYERS_PREFIX}{i}.{name}": tuple(t.shape) for i, layer in enumerate(layers)
              for name, t in layer.state_dict(keep_vars=True).items()}
    sources: list[dict[str, tuple[Path, str]]] = [{} for _ in range(num_layers)]
    for key, shape in shapes.items():
        renamed, converted = rename_source_key(key, renamings, converters)
        if not renamed.startswith(LAYERS_PREFIX):
            continue
        if converted is not None:
            raise CheckpointError(f"{folder}: the encoder layer tensor {key} is converted on load (not only renamed): "
                                  "it cannot be read on its own")
        if renamed not in wanted:
            raise CheckpointError(f"{folder}: the checkpoint key {key} names {renamed}, not a tensor of the encoder "
                                  "layers")
        index, name = renamed[len(LAYERS_PREFIX):].split(".", 1)
        found = _LAYER_KEY.search(key)
        if found is None or found.group(1) != index:
            raise CheckpointError(f"{folder}: the checkpoint key {key} is read into layer {index}")
        if tuple(shape) != wanted[renamed]:
            raise CheckpointError(f"{folder}: {key} has shape {tuple(shape)}, {renamed} is {wanted[renamed]}")
        if name in sources[int(index)]:
            raise CheckpointError(f"{folder}: two checkpoint keys fill {renamed}")
        sources[int(index)][name] = (files[key], key)
    missing = [k for k in wanted if k[len(LAYERS_PREFIX):].split(".", 1)[1] not in
               sources[int(k[len(LAYERS_PREFIX):].split(".", 1)[0])]]
    if missing:
        raise CheckpointError(f"{folder}: no checkpoint tensor for {len(missing)} encoder layer tensor(s), e.g. "
                              f"{missing[0]}")
    return sources


def load_streamed_reference(model_ref, revision: str | None = None):
    """(model, processor): `checkpoint.load_reference`'s float32 reference whose encoder layers are read
    from the checkpoint while they run (its `LayerStream` is `model.layer_stream`); the rest of the model
    is loaded as usual. Raises CheckpointError naming the problem."""
    import torch
    from transformers import AutoConfig, AutoProcessor, CohereAsrForConditionalGeneration, CohereAsrProcessor

    source = resolve_checkpoint(model_ref, revision)
    check_checkpoint_dir(source.local_dir)
    folder = source.local_dir
    try:
        config = AutoConfig.from_pretrained(folder)
        num_layers = config.encoder_config.num_hidden_layers
        config.encoder_config.num_hidden_layers = 0  # every weight but the encoder layers'
        tf_log = logging.getLogger("transformers")
        level = tf_log.level
        tf_log.setLevel(logging.ERROR)  # the layers' keys are "unexpected" to a model without them
        try:
            model = CohereAsrForConditionalGeneration.from_pretrained(folder, config=config, use_safetensors=True,
                                                                      dtype=torch.float32)
        finally:
            tf_log.setLevel(level)
        processor = AutoProcessor.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"could not load the checkpoint in {folder}: {err}") from err
    if not isinstance(processor, CohereAsrProcessor):
        raise CheckpointError(f"{folder} has a {type(processor).__name__}, not a CohereAsrProcessor")
    encoder_config = model.model.encoder.config
    encoder_config.num_hidden_layers = num_layers
    with torch.device("meta"):  # transformers' own layer modules, without storage
        layers = type(model.model.encoder)(encoder_config).layers
    model.model.encoder.layers = layers
    files = {}
    shapes: dict[str, list[int]] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        found = safetensors_file_shapes(path)
        shapes.update(found)
        files.update(dict.fromkeys(found, path))
    sources = layer_sources(model, folder, shapes, files, num_layers)
    model.eval()
    model.source = source
    model.layer_stream = LayerStream(layers, sources, torch.float32)
    return model, processor


def resident_layers(model, start: int = 0, stop: int | None = None):
    """Context: encoder layers [start, stop) of `model` read and kept within (`LayerStream.resident`); nothing
    to do for a model loaded whole."""
    stream = getattr(model, "layer_stream", None)
    return contextlib.nullcontext() if stream is None else stream.resident(start, stop)


def _trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc `malloc_trim(0)`; nothing elsewhere). A released
    layer leaves holes in the heap that other allocations split, so the next layer's tensors do not fit
    them and the heap grows by most of a layer per layer read (at full size, gigabytes over a pass); trimmed,
    the holes cost no resident memory. `export.memory.release_memory` does the same with a garbage
    collection first (too slow per layer; a released layer's tensors are freed by reference counting)."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass
