import Foundation

/// The value checks of a manifest, ported from the Python loader (`cohere_coreml.bundle.load`: `Bundle.load`'s
/// header and file checks, `integrity.check_sizes`, `checks.check_manifest`), in the same order, so that the
/// first problem found (the field an error names) is the one Python names: every field the loop reads
/// present, of its type and range, and consistent with the others and with the manifest's `io` blocks.
/// Every failure is `BundleError.invalidField` naming the field by its dotted JSON path
/// (`decoder.io.states.self_k.shape`, `languages.en.punctuation[3]`).
/// The package-io comparison (Python's `check_packages`) is `checkIO`, when a package is loaded.
enum ManifestCheck {
    static let maxDim = Int(Int32.max)  // Core ML shapes and int32 ids
    static let computeUnits = ["all", "cpu_only", "cpu_and_gpu", "cpu_and_ne"]
    static let ioDTypes = ["float16", "float32", "int32"]
    static let precisions = ["fp16", "fp32"]
    static let languages = ["ar", "de", "el", "en", "es", "fr", "it", "ja", "ko", "nl", "pl", "pt", "vi", "zh"]
    static let noSpaceLanguages = ["ja", "zh"]
    static let memoryNames = ["cross_k", "cross_v", "cross_mask"]
    static let bindInputPrefix = "encoder_"
    static let bindOutput = "memory_length"
    static let padToken = "<pad>", eosToken = "<|endoftext|>", bosToken = "<|startoftranscript|>"
    /// processor_config.json's feature-extractor key -> the manifest's audio field.
    static let processorAudioKeys: [(String, String)] = [
        ("sampling_rate", "sampling_rate"), ("n_fft", "n_fft"), ("win_length", "win_length"), ("hop_length", "hop_length"),
        ("feature_size", "n_mels"), ("preemphasis", "preemphasis"), ("max_audio_clip_s", "max_audio_clip_s"),
        ("overlap_chunk_second", "overlap_chunk_second"), ("min_energy_window_samples", "min_energy_window_samples")]
    /// Suffix every `files` entry must have (Python's order: the first wrong one is named).
    static let fileSuffixes: [(String, String)] = [
        ("encoder", ".mlpackage"), ("decoder", ".mlpackage"), ("frontend", ".mlpackage"), ("vad", ".mlpackage"), ("vocab", ".json"),
        ("tokenizer", "tokenizer.json"), ("processor_config", ".json"), ("tokenizer_config", ".json")]
    static let requiredFiles = ["encoder", "decoder", "vocab", "tokenizer", "processor_config"]

    /// The decoder prompt pieces of `language` (Python's `tokens.prompt_tokens`).
    static func promptTokens(_ language: String, punctuation: Bool) -> [String] {
        let lang = "<|\(language)|>"
        return ["\u{2581}", "<|startofcontext|>", bosToken, "<|emo:undefined|>", lang, lang,
                punctuation ? "<|pnc|>" : "<|nopnc|>", "<|noitn|>", "<|notimestamp|>", "<|nodiarize|>"]
    }

    // MARK: - Typed reads by dotted path (Python's `_Fields`)

    static func fail(_ field: String, _ problem: String) -> BundleError { .invalidField(field: field, problem: problem) }

    /// The value at `key`; nil when `optional` and missing or null; missing and not optional: an error.
    static func get(_ o: JSONObject, _ key: String, _ path: String, optional: Bool) throws -> JSONValue? {
        guard let value = o[key], !(optional && value == .null) else {
            if optional { return nil }
            throw fail(path, "is missing")
        }
        return value
    }

    static func obj(_ o: JSONObject, _ key: String, _ path: String, optional: Bool = false) throws -> JSONObject? {
        guard let value = try get(o, key, path, optional: optional) else { return nil }
        guard let object = value.object else { throw fail(path, "must be an object, got \(value.shown)") }
        return object
    }

    static func obj(_ o: JSONObject, _ key: String, _ path: String) throws -> JSONObject {
        try obj(o, key, path, optional: false)!
    }

    static func int(_ o: JSONObject, _ key: String, _ path: String, lo: Int = 0, hi: Int = maxDim,
                    optional: Bool = false) throws -> Int? {
        guard let value = try get(o, key, path, optional: optional) else { return nil }
        switch value {
        case .int(let i):
            guard lo <= i, i <= hi else { throw fail(path, "is \(i), outside [\(lo), \(hi)]") }
            return i
        case .bigInt(let digits): throw fail(path, "is \(digits), outside [\(lo), \(hi)]")
        default: throw fail(path, "must be an integer, got \(value.shown)")
        }
    }

    static func int(_ o: JSONObject, _ key: String, _ path: String, lo: Int = 0, hi: Int = maxDim) throws -> Int {
        try int(o, key, path, lo: lo, hi: hi, optional: false)!
    }

    static func num(_ o: JSONObject, _ key: String, _ path: String, _ lo: Double, _ hi: Double, loOpen: Bool = false,
                    hiOpen: Bool = false, optional: Bool = false) throws -> Double? {
        guard let value = try get(o, key, path, optional: optional) else { return nil }
        let x: Double
        switch value {
        case .int(let i): x = Double(i)
        case .bigInt(let digits): x = Double(digits) ?? .infinity
        case .double(let d) where d.isFinite: x = d
        default: throw fail(path, "must be a finite number, got \(value.shown)")
        }
        if x < lo || x > hi || (loOpen && x == lo) || (hiOpen && x == hi) {
            throw fail(path, "is \(value.shown), outside \(loOpen ? "(" : "[")\(lo), \(hi)\(hiOpen ? ")" : "]")")
        }
        return x
    }

    static func str(_ o: JSONObject, _ key: String, _ path: String, _ choices: [String]? = nil,
                    optional: Bool = false) throws -> String? {
        guard let value = try get(o, key, path, optional: optional) else { return nil }
        guard case .string(let s) = value, !s.isEmpty else { throw fail(path, "must be a non-empty string, got \(value.shown)") }
        if let choices, !choices.contains(s) { throw fail(path, "is \(value.shown), not one of \(choices)") }
        return s
    }

    static func ints(_ o: JSONObject, _ key: String, _ path: String, lo: Int = 0, hi: Int = maxDim,
                     optional: Bool = false) throws -> [Int]? {
        guard let value = try get(o, key, path, optional: optional) else { return nil }
        guard case .array(let items) = value else { throw fail(path, "must be a list of integers, got \(value.shown)") }
        return try items.enumerated().map { i, item in
            guard case .int(let v) = item, lo <= v, v <= hi else {
                throw fail("\(path)[\(i)]", "must be an integer in [\(lo), \(hi)], got \(item.shown)")
            }
            return v
        }
    }

    static func ints(_ o: JSONObject, _ key: String, _ path: String, lo: Int = 0, hi: Int = maxDim) throws -> [Int] {
        try ints(o, key, path, lo: lo, hi: hi, optional: false)!
    }

    /// An io block {"inputs"|"outputs"|"states": {name: {"shape": [int], "dtype": str}}}.
    static func io(_ o: JSONObject, _ key: String, _ path: String, optional: Bool = false) throws -> JSONObject? {
        guard let block = try obj(o, key, path, optional: optional) else { return nil }
        for kind in ["inputs", "outputs", "states"] {
            let arrays: JSONObject = try obj(block, kind, "\(path).\(kind)")
            for (name, desc) in arrays.entries {
                let at = "\(path).\(kind).\(name)"
                guard let d = desc.object else { throw fail(at, "must be an object, got \(desc.shown)") }
                _ = try ints(d, "shape", "\(at).shape", lo: 0)
                _ = try str(d, "dtype", "\(at).dtype", ioDTypes)
            }
        }
        return block
    }

    static func io(_ o: JSONObject, _ key: String, _ path: String) throws -> JSONObject { try io(o, key, path, optional: false)! }

    /// (shape, dtype) of a checked io block's array, or an error naming the kind that lacks it.
    static func array(_ block: JSONObject, _ kind: String, _ name: String, _ path: String) throws -> (shape: JSONValue, dtype: JSONValue) {
        let arrays = block[kind]!.object!
        guard let desc = arrays[name]?.object else {
            throw fail("\(path).\(kind)", "lists no '\(name)' (has \(arrays.keys.sorted()))")
        }
        return (desc["shape"]!, desc["dtype"]!)
    }

    static func equal(_ field: String, _ value: JSONValue, _ otherField: String, _ other: JSONValue) throws {
        if value != other { throw fail(field, "is \(value.shown) but \(otherField) is \(other.shown): they must agree") }
    }

    static func equal(_ field: String, _ value: Int, _ otherField: String, _ other: Int) throws {
        try equal(field, .int(value), otherField, .int(other))
    }

    static func equal(_ field: String, _ value: [Int], _ otherField: String, _ other: [Int]) throws {
        try equal(field, shape(value), otherField, shape(other))
    }

    static func shape(_ dims: [Int]) -> JSONValue { .array(dims.map { .int($0) }) }

    /// `decoder.alignment` (word timings; absent in bundles exported before them), Python's `_check_alignment`:
    /// null with a reason in `decoder.alignment_note`, or the align function's heads, rows, frame length, io and
    /// calibration figures.
    static func checkAlignment(_ dec: JSONObject, capacity: Int, layers: Int, memoryShape: [Int], memoryLength: Int) throws {
        guard dec["alignment"] != nil else { return }
        let block = try obj(dec, "alignment", "decoder.alignment", optional: true)
        let note = try str(dec, "alignment_note", "decoder.alignment_note", optional: true)
        guard let block else {
            if note == nil {
                throw fail("decoder.alignment_note", "is missing: a bundle without alignment says why (a non-empty string)")
            }
            return
        }
        if let note { throw fail("decoder.alignment_note", "is \(JSONValue.string(note).shown) but decoder.alignment is set: null when it is") }
        _ = try str(block, "function", "decoder.alignment.function", ["align"])
        let length: Int = try int(block, "length", "decoder.alignment.length", lo: 1, hi: capacity)  // K: tokens a call
        let headsPerLayer: Int = try int(dec, "num_attention_heads", "decoder.num_attention_heads", lo: 1)
        let heads = try get(block, "heads", "decoder.alignment.heads", optional: false)!
        guard case .array(let pairs) = heads, !pairs.isEmpty else {
            throw fail("decoder.alignment.heads", "must be a non-empty list of [layer, head], got \(heads.shown)")
        }
        for (i, pair) in pairs.enumerated() {
            guard case .array(let items) = pair, items.count == 2, case .int(let layer) = items[0], case .int(let head) = items[1],
                  (0..<layers).contains(layer), (0..<headsPerLayer).contains(head) else {
                throw fail("decoder.alignment.heads[\(i)]", "must be [layer, head] inside \(layers) layers x \(headsPerLayer) heads, "
                           + "got \(pair.shown)")
            }
        }
        _ = try int(block, "lead_rows", "decoder.alignment.lead_rows", lo: 0, hi: capacity - 1)
        _ = try num(block, "frame_seconds", "decoder.alignment.frame_seconds", 0, 10, loOpen: true)
        let alignIO: JSONObject = try io(block, "io", "decoder.alignment.io")
        // the host-state extend's inputs (input_ids (1, K), position, cache_mask) in either state variant
        let expected: [(kind: String, name: String, shape: [Int], dtype: String, what: String)] = [
            ("inputs", "input_ids", [1, length], "int32", "[1, decoder.alignment.length]"),
            ("inputs", "position", [1], "int32", "[1]"),
            ("inputs", "cache_mask", [1, 1, 1, capacity], "float16", "[1, 1, 1, decoder.capacity]"),
            ("outputs", BundleManifest.alignOutput, [1, pairs.count, length, memoryLength], "float16",
             "[1, heads, decoder.alignment.length, encoder.memory_len]"),
            ("states", "cross_k", memoryShape, "float16", "decoder.memory_shape"),
            ("states", "cross_v", memoryShape, "float16", "decoder.memory_shape")]
        for e in expected {
            let got = try array(alignIO, e.kind, e.name, "decoder.alignment.io")
            try equal("decoder.alignment.io.\(e.kind).\(e.name).shape", got.shape, e.what, shape(e.shape))
            try equal("decoder.alignment.io.\(e.kind).\(e.name).dtype", got.dtype, "dtype", .string(e.dtype))
        }
        if let calibration = try obj(block, "calibration", "decoder.alignment.calibration", optional: true) {
            _ = try str(calibration, "set", "decoder.alignment.calibration.set")
            for key in ["clips", "words"] { _ = try int(calibration, key, "decoder.alignment.calibration.\(key)", lo: 1) }
            for key in ["median_s", "p90_s", "baseline_median_s"] {
                _ = try num(calibration, key, "decoder.alignment.calibration.\(key)", 0, 1e6)
            }
        }
    }

    /// `decoder.batch` and `decoder.functions.step_batch` (docs/bundle.md, "Decoding several windows at once"), Python's
    /// `checks._check_batch`: both or neither, a host-state decoder only, B = `size` >= 2 rows, and the function's io
    /// the step's with B rows: input_ids (B, 1), position (B), cache_mask (B, 1, 1, C) in; log_probs (B, V) and the new
    /// K/V rows (L, B*Hkv, 1, Dh) out; states of B rows folded into the head axis (self_k (L, B*Hkv, C, Dh), cross_k
    /// (L, B*Hkv, Tp, Dh), cross_mask (B, 1, 1, Tp)).
    static func checkBatch(_ dec: JSONObject, functions: JSONObject, host: Bool, cache: [Int], vocabSize: Int, output: String,
                           programFloat: String, memoryShape: [Int], memoryLength: Int) throws {
        let name = try str(functions, "step_batch", "decoder.functions.step_batch", optional: true)
        let batch = try obj(dec, "batch", "decoder.batch", optional: true)
        if (name == nil) != (batch == nil) {
            throw fail("decoder.batch", "must be given exactly when decoder.functions.step_batch is (it is "
                       + "\(name.map { JSONValue.string($0).shown } ?? "null"))")
        }
        guard let batch else { return }
        if !host {
            throw fail("decoder.batch", "is set but the decoder is not a host-state one: the graph variant has no batched step")
        }
        let size: Int = try int(batch, "size", "decoder.batch.size", lo: 2)
        let block: JSONObject = try io(batch, "io", "decoder.batch.io")
        let ids = try array(block, "inputs", "input_ids", "decoder.batch.io").shape
        if ids != shape([size, 1]) {
            throw fail("decoder.batch.size", "is \(size); the batched step takes input_ids of shape [B, 1] with B >= 2 "
                       + "(decoder.batch.io says \(ids.shown))")
        }
        let (layers, kvHeads, capacity, headDim) = (cache[0], cache[1], cache[2], cache[3])
        let rows = [layers, size * kvHeads]
        let rowsWhat = "[num_layers, decoder.batch.size * num_key_value_heads"
        var expected: [(kind: String, name: String, shape: [Int], dtype: String, what: String)] = [
            ("inputs", "input_ids", [size, 1], "int32", "[decoder.batch.size, 1]"),
            ("inputs", "position", [size], "int32", "[decoder.batch.size]"),
            ("inputs", "cache_mask", [size, 1, 1, capacity], "float16", "[decoder.batch.size, 1, 1, decoder.capacity]"),
            ("outputs", output, [size, vocabSize], programFloat, "[decoder.batch.size, decoder.vocab_size]")]
        for name in ["new_k", "new_v"] {  // Python's NEW_ROWS_OUTPUTS, in its order
            expected.append(("outputs", name, rows + [1, headDim], "float16", "\(rowsWhat), 1, head_dim]"))
        }
        for name in ["self_k", "self_v"] {
            expected.append(("states", name, rows + [capacity, headDim], "float16", "\(rowsWhat), capacity, head_dim]"))
        }
        for name in memoryNames {
            expected.append(name == "cross_mask"
                ? ("states", name, [size, 1, 1, memoryLength], "float16", "[decoder.batch.size, 1, 1, encoder.memory_len]")
                : ("states", name, rows + Array(memoryShape.dropFirst(2)), "float16", "\(rowsWhat), encoder.memory_len, head_dim]"))
        }
        let takes = expected.filter { $0.kind == "inputs" }.map(\.name).sorted()
        let inputs = block["inputs"]!.object!.keys.sorted()
        if inputs != takes {
            throw fail("decoder.batch.io.inputs", "are \(inputs); the batched step takes \(takes) (the cross memory is in the "
                       + "state, written by the host into each row)")
        }
        for e in expected {
            let got = try array(block, e.kind, e.name, "decoder.batch.io")
            try equal("decoder.batch.io.\(e.kind).\(e.name).shape", got.shape, e.what, shape(e.shape))
            try equal("decoder.batch.io.\(e.kind).\(e.name).dtype", got.dtype, "dtype", .string(e.dtype))
        }
    }

    /// Silero VAD's 16 kHz numbers the host frames the audio with (docs/vad.md), in the order they are checked.
    static let vadNumbers: [(key: String, value: Int)] = [("sample_rate", 16000), ("chunk_samples", 512),
                                                          ("context_samples", 64), ("hidden", 128)]

    /// `vad` (optional; docs/vad.md), Python's `_check_vad`: given exactly when `files.vad` is; Silero VAD's
    /// 16 kHz numbers; the `block` function's rows (chunks) >= 1 and the `chunk` function's 1; each function's io
    /// shapes consistent with them (frames (chunks, context + chunk), h and c (1, hidden) in; probability
    /// (1, chunks), h_out and c_out (1, hidden) out).
    static func checkVAD(_ m: JSONObject) throws {
        let files = m["files"]?.object ?? JSONObject()
        let vad = try obj(m, "vad", "vad", optional: true)
        if (vad == nil) != ((files["vad"] ?? .null) == .null) {
            throw fail("vad", "and files.vad must be given together (a bundle with vad.mlpackage has both)")
        }
        guard let vad else { return }
        var numbers: [String: Int] = [:]
        for (key, want) in vadNumbers {
            let value: Int = try int(vad, key, "vad.\(key)", lo: 1)
            try equal("vad.\(key)", value, "Silero VAD's 16 kHz network's", want)
            numbers[key] = value
        }
        let frameSamples = numbers["context_samples"]! + numbers["chunk_samples"]!, hidden = numbers["hidden"]!
        let functions: JSONObject = try obj(vad, "functions", "vad.functions")
        for name in [VoiceActivity.blockFunction, VoiceActivity.chunkFunction] {
            let path = "vad.functions.\(name)"
            let fn: JSONObject = try obj(functions, name, path)
            let chunks: Int = try int(fn, "chunks", "\(path).chunks", lo: 1)
            if name == VoiceActivity.chunkFunction { try equal("\(path).chunks", chunks, "the stream's one chunk a call", 1) }
            let block: JSONObject = try io(fn, "io", "\(path).io")
            let expected: [(kind: String, name: String, shape: [Int], what: String)] = [
                ("inputs", "frames", [chunks, frameSamples], "[\(path).chunks, vad.context_samples + vad.chunk_samples]"),
                ("inputs", "h", [1, hidden], "[1, vad.hidden]"), ("inputs", "c", [1, hidden], "[1, vad.hidden]"),
                ("outputs", "probability", [1, chunks], "[1, \(path).chunks]"),
                ("outputs", "h_out", [1, hidden], "[1, vad.hidden]"), ("outputs", "c_out", [1, hidden], "[1, vad.hidden]")]
            for e in expected {  // shapes (the dtypes are compared with the package's own io when it loads)
                let got = try array(block, e.kind, e.name, "\(path).io")
                try equal("\(path).io.\(e.kind).\(e.name).shape", got.shape, e.what, shape(e.shape))
            }
        }
    }

    // MARK: - Bundle.load: header, files, checksums

    /// `encoder.parts` (Python's `bundle._check_encoder_parts`): programs of consecutive layers covering
    /// `encoder.num_layers` from layer 0, each in the file its `files` key names, each with every function of
    /// `encoder.functions`; the first takes the function's inputs, the last gives its outputs, each other
    /// hands its hidden state (and the encoder mask) on.
    static func checkEncoderParts(_ m: JSONObject, _ enc: JSONObject, _ encFunctions: JSONObject,
                                  masks: BundleManifest.LengthMasks, framesOf: [String: Int]) throws {
        let numLayers: Int = try int(enc, "num_layers", "encoder.num_layers", lo: 1, hi: 100_000)
        guard case .array(let parts)? = enc["parts"], !parts.isEmpty else {
            throw fail("encoder.parts", "must be a non-empty list of the encoder's programs, got \((enc["parts"] ?? .null).shown)")
        }
        let files = m["files"]?.object ?? JSONObject()
        var start = 0
        var ios: [[String: JSONObject]] = []
        var keys: Set<String> = []
        for (i, value) in parts.enumerated() {
            let path = "encoder.parts[\(i)]"
            guard let part = value.object else { throw fail(path, "must be an object, got \(value.shown)") }
            let want = i == 0 ? "encoder" : "encoder_part\(i + 1)"
            guard part["file"] == .string(want) else {
                throw fail("\(path).file", "is \((part["file"] ?? .null).shown); part \(i + 1) is in files.\(want)")
            }
            guard case .string? = files[want] else {
                throw fail("\(path).file", "names files.\(want), which the manifest does not give")
            }
            keys.insert(want)
            let layers: [Int] = try ints(part, "layers", "\(path).layers", hi: numLayers)
            guard layers.count == 2, layers[0] == start, layers[1] > start else {
                throw fail("\(path).layers", "is \((part["layers"] ?? .null).shown); part \(i + 1) holds layers [\(start), stop) "
                           + "with stop > \(start)")
            }
            start = layers[1]
            let functions: JSONObject = try obj(part, "functions", "\(path).functions")
            guard functions.keys.sorted() == encFunctions.keys.sorted() else {
                throw fail("\(path).functions", "are \(functions.keys.sorted()), but the encoder functions (encoder.functions) are "
                           + "\(encFunctions.keys.sorted()): every part has every window's function")
            }
            var byFunction: [String: JSONObject] = [:]
            for (fn, entry) in functions.entries {
                guard let e = entry.object else { throw fail("\(path).functions.\(fn)", "must be an object, got \(entry.shown)") }
                byFunction[fn] = try io(e, "io", "\(path).functions.\(fn).io")
            }
            ios.append(byFunction)
        }
        guard start == numLayers else {
            throw fail("encoder.parts", "end at layer \(start), the encoder has encoder.num_layers = \(numLayers)")
        }
        let extra = files.keys.filter { $0.hasPrefix("encoder_part") && !keys.contains($0) }.sorted()
        if !extra.isEmpty { throw fail("files", "names \(extra), which encoder.parts does not list") }
        for (fn, entry) in encFunctions.entries {
            let chain = entry.object!["io"]!.object!
            try equal("encoder.parts[0].functions.\(fn).io.inputs", ios[0][fn]!["inputs"]!, "encoder.functions.\(fn).io.inputs",
                      chain["inputs"]!)
            try equal("encoder.parts[\(ios.count - 1)].functions.\(fn).io.outputs", ios[ios.count - 1][fn]!["outputs"]!,
                      "encoder.functions.\(fn).io.outputs", chain["outputs"]!)
            let t = masks.lengths(framesOf[fn]!).last ?? 0
            for i in 0..<(ios.count - 1) {
                let outputs = ios[i][fn]!["outputs"]?.object ?? JSONObject()
                let hidden = outputs["hidden_states_out"]?.object
                guard outputs.keys == ["hidden_states_out"], case .array(let shape)? = hidden?["shape"], shape.count == 3,
                      shape[0] == .int(1), shape[1] == .int(t) else {
                    throw fail("encoder.parts[\(i)].functions.\(fn).io.outputs", "are \((ios[i][fn]!["outputs"] ?? .null).shown); a part "
                               + "before the last gives only hidden_states_out [1, \(t), hidden size]")
                }
                var want = JSONObject()
                want["hidden_states"] = outputs["hidden_states_out"]!
                var mask = JSONObject()
                mask["shape"] = .array([.int(1), .int(t)])
                mask["dtype"] = .string("float16")
                want["encoder_mask"] = .object(mask)
                let next = ios[i + 1][fn]!["inputs"] ?? .null
                guard let n = next.object, n.keys.sorted() == ["encoder_mask", "hidden_states"],
                      n["hidden_states"] == want["hidden_states"], n["encoder_mask"]?.object?["shape"] == mask["shape"],
                      n["encoder_mask"]?.object?["dtype"] == mask["dtype"] else {
                    throw fail("encoder.parts[\(i + 1)].functions.\(fn).io.inputs", "are \(next.shown); the part after part \(i + 1) "
                               + "takes \(JSONValue.object(want).shown)")
                }
            }
        }
    }

    /// `format`, `format_version` and `files` (every path safe, of its suffix, the required ones named);
    /// with `bundle`, every named file present there.
    static func checkHeaderAndFiles(_ m: JSONObject, bundle: URL?) throws {
        guard m["format"] == .string(BundleManifest.formatName) else {
            throw BundleError.unsupportedFormat("manifest format is \(m["format"].map(\.shown) ?? "missing"), "
                                                + "expected '\(BundleManifest.formatName)'")
        }
        let version = m["format_version"] ?? .null
        switch version {
        case .int(let v) where v >= 1:
            guard v <= BundleManifest.supportedFormatVersion else {
                throw BundleError.newerFormatVersion(found: v, supported: BundleManifest.supportedFormatVersion)
            }
            guard v == BundleManifest.supportedFormatVersion else {
                throw BundleError.unsupportedFormat(
                    "bundle format_version \(v) is an older format this package no longer reads (format "
                        + "\(BundleManifest.supportedFormatVersion): the encoder takes its length masks from the host): "
                        + "re-export the bundle with `cohere-coreml export --force`")
            }
        case .bigInt(let digits) where !digits.hasPrefix("-"):
            throw BundleError.newerFormatVersion(found: Int.max, supported: BundleManifest.supportedFormatVersion)
        default:
            throw fail("format_version", "must be a positive integer, got \(version.shown)")
        }
        guard let files = m["files"]?.object else {
            throw fail("files", "must be an object naming the bundle's files, got \((m["files"] ?? .null).shown)")
        }
        for (key, value) in files.entries where value != .null {
            let reason: String?
            if case .string(let path) = value { reason = BundlePath.unsafeReason(path) } else { reason = "not a non-empty string" }
            if let reason {
                throw BundleError.unsafePath("manifest files.\(key) \(value.shown) is refused: \(reason); bundle paths stay inside the bundle")
            }
        }
        for (key, suffix) in fileSuffixes {
            if case .string(let name)? = files[key], !name.hasSuffix(suffix) {
                throw fail("files.\(key)", "is '\(name)'; it names a \(suffix) file")
            }
        }
        for key in requiredFiles + ["frontend", "vad"] {
            guard case .string(let name)? = files[key] else {
                if key == "frontend" || key == "vad" { continue }
                throw fail("files.\(key)", "is missing: the manifest describes no \(key); export it (`cohere-coreml export`)")
            }
            if let bundle, !FileManager.default.fileExists(atPath: bundle.appendingPathComponent(name).path) {
                throw BundleError.missingFile("bundle is missing \(name) (looked in \(bundle.path))")
            }
        }
        // an encoder in parts: its later programs (Python's Bundle.load, after the front end)
        for (key, value) in files.entries where key.hasPrefix("encoder_part") && value != .null {
            guard case .string(let name) = value, name.hasSuffix(".mlpackage") else {
                throw fail("files.\(key)", "is \(value.shown); it names a .mlpackage file")
            }
            if let bundle, !FileManager.default.fileExists(atPath: bundle.appendingPathComponent(name).path) {
                throw BundleError.missingFile("bundle is missing \(name) (looked in \(bundle.path))")
            }
        }
    }

    /// `checksums` (Python's `integrity.check_sizes`): a well-formed table whose total is the sum of its
    /// sizes; with `bundle`, every listed file there (no symbolic link on the way) of its listed size.
    static func checkChecksums(_ m: JSONObject, bundle: URL?) throws {
        guard let checksums = m["checksums"], checksums != .null else { return }
        guard let section = checksums.object else { throw fail("checksums", "must be an object") }
        let listed = section["files"] ?? .null
        switch listed {  // Python: `if not listed: return` (an empty or false value lists nothing)
        case .null, .bool(false), .int(0), .string(""), .array([]): return
        case .double(let d) where d == 0: return
        case .object(let o) where o.count == 0: return
        default: break
        }
        guard let table = listed.object else { throw fail("checksums.files", "must be an object") }
        var sizes: [(String, Int?)] = []
        for (rel, want) in table.entries {
            if let reason = BundlePath.unsafeReason(rel) {
                throw BundleError.unsafePath("manifest checksums entry '\(rel)' is refused: \(reason); bundle paths stay inside the bundle")
            }
            let entry = want.object
            // a size beyond Int64 is an integer >= 0 as Python reads it (then matches no total and no file): nil
            let size: Int??
            switch entry?["size"] {
            case .int(let v)? where v >= 0: size = .some(v)
            case .bigInt(let digits)? where !digits.hasPrefix("-"): size = .some(nil)
            default: size = nil
            }
            guard let size, case .string(let digest)? = entry?["sha256"], digest.utf8.count == 64,
                  digest.utf8.allSatisfy({ (0x30...0x39).contains($0) || (0x61...0x66).contains($0) })
            else {
                throw fail("checksums.files.\(rel)", "must be {\"sha256\": 64 hex digits, \"size\": bytes >= 0}, got \(want.shown)")
            }
            sizes.append((rel, size))
        }
        let (sum, overflow) = sizes.reduce((0, false)) { acc, e in
            guard let size = e.1 else { return (acc.0, true) }
            let (s, o) = acc.0.addingReportingOverflow(size)
            return (s, acc.1 || o)
        }
        if let total = section["total_bytes"], total != .null, overflow || total != .int(sum) {
            throw fail("checksums.total_bytes", "is \(total.shown) but the listed files hold \(sum) bytes")
        }
        guard let bundle else { return }
        var problems: [String] = []
        for (rel, size) in sizes.sorted(by: { Array($0.0.unicodeScalars.map(\.value)).lexicographicallyPrecedes($1.0.unicodeScalars.map(\.value)) }) {
            var info = stat()  // (stat, not FileManager's attributes: this runs for every listed file at every load)
            if let link = symbolicLink(on: rel, in: bundle) {
                problems.append("\(rel): reached through a symbolic link (\(link)), refused")
            } else if stat(bundle.appendingPathComponent(rel).path, &info) != 0 || (info.st_mode & S_IFMT) != S_IFREG {
                problems.append("\(rel): missing")
            } else if Int(info.st_size) != size {
                problems.append("\(rel): size \(info.st_size) != \(size.map(String.init) ?? "(beyond 64 bits)") in the manifest")
            }
        }
        if !problems.isEmpty {
            let message = "\(bundle.path): \(problems.count) file(s) do not match \(BundleManifest.fileName):\n  "
                + problems.joined(separator: "\n  ")
            if problems.contains(where: { $0.contains("symbolic link") }) { throw BundleError.unsafePath(message) }
            throw BundleError.missingFile("\(bundle.path): \(problems.count) file(s) do not match \(BundleManifest.fileName):\n  "
                                          + problems.joined(separator: "\n  "))
        }
    }

    /// The first of `root` and the folders and file on the way to `root/rel` that is a symbolic link, or nil
    /// (Python's `integrity._symlinks_on`).
    static func symbolicLink(on rel: String, in root: URL) -> String? {
        func isLink(_ url: URL) -> Bool {
            var info = stat()
            return lstat(url.path, &info) == 0 && (info.st_mode & S_IFMT) == S_IFLNK
        }
        if isLink(root) { return root.path }
        var here = root
        for part in rel.split(separator: "/") {
            here = here.appendingPathComponent(String(part))
            if isLink(here) { return here.path }
        }
        return nil
    }

    /// files.vocab ({id: piece}) and files.processor_config of `bundle`, as Python's `Bundle.load` reads them.
    static func readVocabAndProcessor(_ m: JSONObject, bundle: URL) throws -> (vocab: [String: String], processor: JSONValue) {
        let files = m["files"]!.object!
        func read(_ key: String) throws -> JSONValue {
            guard case .string(let name)? = files[key] else { throw fail("files.\(key)", "is missing") }
            let url = bundle.appendingPathComponent(name)
            do {
                return try JSONValue.parse(try Data(contentsOf: url))
            } catch {
                throw BundleError.unreadableManifest("\(url.path) (files.\(key)) is not readable JSON: \(error)")
            }
        }
        let raw = try read("vocab")
        var vocab: [String: String] = [:]
        guard let table = raw.object else { throw BundleError.unreadableManifest("files.vocab is not an {id: piece} table") }
        for (id, piece) in table.entries {
            guard case .string(let p) = piece else { throw BundleError.unreadableManifest("files.vocab is not an {id: piece} table") }
            vocab[id] = p
        }
        return (vocab, try read("processor_config"))
    }

    // MARK: - check_manifest

    /// Every field `Transcriber` reads, in Python's `check_manifest` order. `vocab` checks the prompts and
    /// eos / pad / bos ids; `processor` (processor_config.json) the audio settings.
    static func checkManifest(_ m: JSONObject, vocab: [String: String]?, processor: JSONValue?) throws {
        let precision = try str(m, "precision", "precision", precisions, optional: true)

        // audio: the front end
        let audio: JSONObject = try obj(m, "audio", "audio")
        _ = try int(audio, "sampling_rate", "audio.sampling_rate", lo: 1000, hi: 1_000_000)
        let nFFT: Int = try int(audio, "n_fft", "audio.n_fft", lo: 2, hi: 1 << 16)
        _ = try int(audio, "win_length", "audio.win_length", lo: 1, hi: nFFT)
        let hop: Int = try int(audio, "hop_length", "audio.hop_length", lo: 1, hi: nFFT)
        let nMels: Int = try int(audio, "n_mels", "audio.n_mels", lo: 1, hi: 4096)
        _ = try num(audio, "preemphasis", "audio.preemphasis", 0, 1, hiOpen: true)
        _ = try num(audio, "dither", "audio.dither", 0, 1, optional: true)
        let clip = try num(audio, "max_audio_clip_s", "audio.max_audio_clip_s", 0, 3600, loOpen: true)!
        _ = try num(audio, "overlap_chunk_second", "audio.overlap_chunk_second", 0, clip, hiOpen: true)
        _ = try int(audio, "min_energy_window_samples", "audio.min_energy_window_samples", lo: 1, hi: maxDim)
        let audioWindow = try int(audio, "window_frames", "audio.window_frames", lo: 1, optional: true)
        if let processor {
            // the feature-extractor settings: processor_config's "feature_extractor" object, or the file itself
            let settings = processor.object.flatMap { file in file["feature_extractor"].map(\.object) ?? file }
            guard let settings, settings["sampling_rate"] != nil else {
                throw BundleError.unreadableManifest("files.processor_config holds no feature-extractor settings")
            }
            for (key, field) in processorAudioKeys {
                let have = audio[field] ?? .null
                if let want = settings[key], want != have {
                    throw fail("audio.\(field)", "is \(have.shown) but the checkpoint's processor config "
                               + "(files.processor_config) says \(key) = \(want.shown)")
                }
            }
        }

        // encoder: window, memory, one function per window (length buckets), each with its io
        let enc: JSONObject = try obj(m, "encoder", "encoder")
        let window: Int = try int(enc, "window_frames", "encoder.window_frames", lo: 2)
        if let audioWindow { try equal("audio.window_frames", audioWindow, "encoder.window_frames", window) }
        let encoderFrames: Int = try int(enc, "encoder_frames", "encoder.encoder_frames", lo: 1)
        let memoryLength: Int = try int(enc, "memory_len", "encoder.memory_len", lo: encoderFrames)
        try equal("encoder.num_mel_bins", try int(enc, "num_mel_bins", "encoder.num_mel_bins", lo: 1), "audio.n_mels", nMels)
        let rule: JSONObject = try obj(enc, "length_masks", "encoder.length_masks")
        let kernel: Int = try int(rule, "kernel_size", "encoder.length_masks.kernel_size", lo: 1, hi: 1024)
        let masks = BundleManifest.LengthMasks(
            kernelSize: kernel,
            stride: try int(rule, "stride", "encoder.length_masks.stride", lo: 1, hi: 1024),
            padding: try int(rule, "padding", "encoder.length_masks.padding", lo: 0, hi: kernel - 1),
            stages: try int(rule, "stages", "encoder.length_masks.stages", lo: 1, hi: 16))
        if masks.lengths(window).last != encoderFrames {
            throw fail("encoder.length_masks", "gives \(masks.lengths(window).last ?? 0) encoder frames for encoder.window_frames "
                       + "\(window), but encoder.encoder_frames is \(encoderFrames)")
        }
        let encFunctions: JSONObject = try obj(enc, "functions", "encoder.functions")
        guard encFunctions["main"] != nil else {
            throw fail("encoder.functions", "has no 'main' function (has \(encFunctions.keys.sorted()))")
        }
        var framesOf: [String: Int] = [:]
        for (name, fn) in encFunctions.entries {
            let path = "encoder.functions.\(name)"
            guard let f = fn.object else { throw fail(path, "must be an object, got \(fn.shown)") }
            framesOf[name] = try int(f, "frames", "\(path).frames", lo: 2, hi: window)
            _ = try num(f, "window_seconds", "\(path).window_seconds", 0, 3600, loOpen: true, optional: true)
            _ = try io(f, "io", "\(path).io")
        }
        try equal("encoder.functions.main.frames", framesOf["main"]!, "encoder.window_frames", window)
        _ = try io(enc, "io", "encoder.io")
        try equal("encoder.io", enc["io"]!, "encoder.functions.main.io", encFunctions["main"]!.object!["io"]!)
        try checkEncoderParts(m, enc, encFunctions, masks: masks, framesOf: framesOf)

        // decoder: cache, prompt, functions and io of the step (and prefill)
        let dec: JSONObject = try obj(m, "decoder", "decoder")
        let capacity: Int = try int(dec, "capacity", "decoder.capacity", lo: 2)
        let promptLength: Int = try int(dec, "prompt_length", "decoder.prompt_length", lo: 1, hi: capacity - 1)
        try equal("decoder.max_new_tokens", try int(dec, "max_new_tokens", "decoder.max_new_tokens", lo: 1),
                  "decoder.capacity - decoder.prompt_length + 1", capacity - promptLength + 1)
        let layers: Int = try int(dec, "num_layers", "decoder.num_layers", lo: 1)
        _ = try int(dec, "num_attention_heads", "decoder.num_attention_heads", lo: 1)
        let kvHeads: Int = try int(dec, "num_key_value_heads", "decoder.num_key_value_heads", lo: 1)
        let headDim: Int = try int(dec, "head_dim", "decoder.head_dim", lo: 1)
        _ = try int(dec, "hidden_size", "decoder.hidden_size", lo: 1)
        let vocabSize: Int = try int(dec, "vocab_size", "decoder.vocab_size", lo: 1)
        let cache = [layers, kvHeads, capacity, headDim]
        try equal("decoder.cache_shape", try ints(dec, "cache_shape", "decoder.cache_shape"),
                  "[num_layers, num_key_value_heads, capacity, head_dim]", cache)
        let memoryShape: [Int] = try ints(dec, "memory_shape", "decoder.memory_shape")
        try equal("decoder.memory_shape", memoryShape, "[num_layers, num_key_value_heads, encoder.memory_len, head_dim]",
                  [layers, kvHeads, memoryLength, headDim])
        let output = try str(dec, "output", "decoder.output", ["log_probs"])!
        // who writes the state (absent: "graph", the exports before --decoder-state)
        let host = try str(dec, "state_writes", "decoder.state_writes", ["host", "graph"], optional: true) == "host"
        let functions: JSONObject = try obj(dec, "functions", "decoder.functions")
        _ = try str(functions, "step", "decoder.functions.step")
        let prefill = try str(functions, "prefill", "decoder.functions.prefill", optional: true)
        let prefillLength = try int(dec, "prefill_length", "decoder.prefill_length", lo: 1, hi: capacity - 1, optional: true)
        if (prefill == nil) != (prefillLength == nil) {
            throw fail("decoder.prefill_length", "is \(prefillLength.map(String.init) ?? "null") but decoder.functions.prefill is "
                       + "\(prefill.map { "\"\($0)\"" } ?? "null"): both are set (a prefill function) or both null")
        }
        let programFloat = precision == "fp32" ? "float32" : "float16"
        let stepIO: JSONObject = try io(dec, "io", "decoder.io")
        let prefillIO = try io(dec, "prefill_io", "decoder.prefill_io", optional: true)
        if (prefill == nil) != (prefillIO == nil) {
            throw fail("decoder.prefill_io", "must be given exactly when decoder.functions.prefill is (it is \(prefill ?? "null"))")
        }
        let extend = try str(functions, "extend", "decoder.functions.extend", optional: true)
        let extendLength = try int(dec, "extend_length", "decoder.extend_length", lo: 1, hi: capacity - promptLength,
                                   optional: true)
        if (extend == nil) != (extendLength == nil) {
            throw fail("decoder.extend_length", "is \(extendLength.map(String.init) ?? "null") but decoder.functions.extend is "
                       + "\(extend.map { "\"\($0)\"" } ?? "null"): both are set (an extend function) or both null")
        }
        let extendIO = try io(dec, "extend_io", "decoder.extend_io", optional: true)
        if (extend == nil) != (extendIO == nil) {
            throw fail("decoder.extend_io", "must be given exactly when decoder.functions.extend is (it is \(extend ?? "null"))")
        }
        let crossMask = [1, 1, 1, memoryLength]
        typealias Expected = (kind: String, name: String, shape: [Int], dtype: String, what: String)
        let idsWhat = ["decoder.io": "[1, 1]", "decoder.prefill_io": "decoder.prefill_length",
                       "decoder.extend_io": "decoder.extend_length"]
        for (path, block, idsLength) in [("decoder.io", Optional(stepIO), 1), ("decoder.prefill_io", prefillIO, prefillLength ?? 0),
                                         ("decoder.extend_io", extendIO, extendLength ?? 0)] {
            guard let block else { continue }
            let isExtend = path == "decoder.extend_io"  // the log-probs after each of the K slots
            var expected: [Expected] = [
                ("inputs", "input_ids", [1, idsLength], "int32", idsWhat[path]!),
                ("outputs", output, isExtend ? [1, idsLength, vocabSize] : [1, vocabSize], programFloat,
                 isExtend ? "[1, decoder.extend_length, decoder.vocab_size]" : "[1, decoder.vocab_size]"),
                ("states", "self_k", cache, "float16", "decoder.cache_shape"),
                ("states", "self_v", cache, "float16", "decoder.cache_shape")]
            if path != "decoder.prefill_io" {
                expected.append(("inputs", "position", [1], "int32", "[1]"))
                if host { expected.append(("inputs", "cache_mask", [1, 1, 1, capacity], "float16", "[1, 1, 1, decoder.capacity]")) }
            }
            if host {  // the call's new K/V rows, which the host writes into self_k / self_v
                for name in ["new_k", "new_v"] {
                    expected.append(("outputs", name, [layers, kvHeads, idsLength, headDim], "float16",
                                     "[num_layers, num_key_value_heads, tokens of the call, head_dim]"))
                }
            }
            // format 2: the cross memory is in the state (fp16), never an input of a step or prefill call
            expected += [("states", "cross_k", memoryShape, "float16", "decoder.memory_shape"),
                         ("states", "cross_v", memoryShape, "float16", "decoder.memory_shape"),
                         ("states", "cross_mask", crossMask, "float16", "[1, 1, 1, encoder.memory_len]")]
            let takes = expected.filter { $0.kind == "inputs" }.map(\.name).sorted()
            let inputs = block["inputs"]!.object!.keys.sorted()
            if inputs != takes {
                throw fail("\(path).inputs", "are \(inputs); a \(host ? "host" : "graph")-state decoder call takes \(takes) "
                           + (host ? "(the cross memory is in the state, written by the host once per window)"
                              : "(the cross memory is bound into the state by decoder.functions.bind)"))
            }
            for e in expected {
                let got = try array(block, e.kind, e.name, path)
                try equal("\(path).\(e.kind).\(e.name).shape", got.shape, e.what, shape(e.shape))
                try equal("\(path).\(e.kind).\(e.name).dtype", got.dtype,
                          ["input_ids", "position"].contains(e.name) ? "int32" : "the dtype of precision '\(precision ?? "null")'",
                          .string(e.dtype))
            }
        }
        if host {  // the host writes the state: no bind function; what it writes, named
            for key in ["bind_inputs", "bind_io"] {
                if let value = dec[key], value != .null {
                    throw fail("decoder.\(key)", "is \(value.shown); a host-state decoder has no bind function (null)")
                }
            }
            if let value = functions["bind"], value != .null {
                throw fail("decoder.functions.bind", "is \(value.shown); a host-state decoder has none (null)")
            }
            var memoryStates = JSONObject()
            for name in memoryNames { memoryStates[name] = .string(name) }
            var rowOutputs = JSONObject()
            rowOutputs["self_k"] = .string("new_k")
            rowOutputs["self_v"] = .string("new_v")
            for (key, want) in [("memory_states", JSONValue.object(memoryStates)), ("row_outputs", .object(rowOutputs)),
                                ("cache_mask_input", .string("cache_mask"))] where dec[key] != want {
                throw fail("decoder.\(key)", "is \(dec[key]?.shown ?? "absent"); a host-state decoder of this format writes \(want.shown)")
            }
        } else {
        // the bind function: the encoder's memory in (under decoder.bind_inputs' names), memory_length out
        let bind = try str(functions, "bind", "decoder.functions.bind")!
        let bindInputs: JSONObject = try obj(dec, "bind_inputs", "decoder.bind_inputs")
        var wantInputs = JSONObject()
        for name in memoryNames { wantInputs[bindInputPrefix + name] = .string(name) }
        if bindInputs != wantInputs {
            throw fail("decoder.bind_inputs", "is \(JSONValue.object(bindInputs).shown); the '\(bind)' function takes "
                       + JSONValue.object(wantInputs).shown)
        }
        let bindIO: JSONObject = try io(dec, "bind_io", "decoder.bind_io")
        let memoryOf: [String: [Int]] = ["cross_k": memoryShape, "cross_v": memoryShape, "cross_mask": crossMask]
        var bindExpected: [(kind: String, name: String, shape: [Int], dtype: String, what: String)] =
            memoryNames.map { ("inputs", bindInputPrefix + $0, memoryOf[$0]!, programFloat, "the shape of the encoder's \($0)") }
        bindExpected += [("outputs", bindOutput, [1], "int32", "the shape of \(bindOutput)"),
                         ("states", "self_k", cache, "float16", "the shape of self_k"),
                         ("states", "self_v", cache, "float16", "the shape of self_v")]
        bindExpected += memoryNames.map { ("states", $0, memoryOf[$0]!, "float16", "the shape of \($0)") }
        for e in bindExpected {
            let got = try array(bindIO, e.kind, e.name, "decoder.bind_io")
            try equal("decoder.bind_io.\(e.kind).\(e.name).shape", got.shape, e.what, shape(e.shape))
            try equal("decoder.bind_io.\(e.kind).\(e.name).dtype", got.dtype, "dtype", .string(e.dtype))
        }
        }
        try checkBatch(dec, functions: functions, host: host, cache: cache, vocabSize: vocabSize, output: output,
                       programFloat: programFloat, memoryShape: memoryShape, memoryLength: memoryLength)
        try checkAlignment(dec, capacity: capacity, layers: layers, memoryShape: memoryShape, memoryLength: memoryLength)
        // every encoder function's io: features of its frames in, the decoder's memory out
        for (name, fn) in encFunctions.entries {
            let path = "encoder.functions.\(name).io"
            let block = fn.object!["io"]!.object!
            let want = (["input_features"] + masks.names).sorted()
            if let inputs = block["inputs"]?.object, inputs.keys.sorted() != want {
                throw fail("\(path).inputs", "are \(inputs.keys.sorted()); a format-\(BundleManifest.supportedFormatVersion) encoder "
                           + "takes \(want) (the length masks of encoder.length_masks)")
            }
            var maskChecks: [Expected] = []
            for (mask, size) in zip(masks.names, masks.lengths(framesOf[name]!)) {
                maskChecks.append(("inputs", mask, [1, size], "float16", "[1, frames of \(mask) by encoder.length_masks]"))
            }
            let checks: [Expected] = [
                ("inputs", "input_features", [1, nMels, framesOf[name]!], "float32", "[1, audio.n_mels, encoder.functions.\(name).frames]")]
                + maskChecks + [
                ("outputs", "cross_k", memoryShape, programFloat, "decoder.memory_shape"),
                ("outputs", "cross_v", memoryShape, programFloat, "decoder.memory_shape"),
                ("outputs", "cross_mask", crossMask, programFloat, "[1, 1, 1, encoder.memory_len]")]
            for e in checks {
                let got = try array(block, e.kind, e.name, path)
                try equal("\(path).\(e.kind).\(e.name).shape", got.shape, e.what, shape(e.shape))
                try equal("\(path).\(e.kind).\(e.name).dtype", got.dtype, "the program's dtype", .string(e.dtype))
            }
        }

        // frontend (optional): one function per encoder window, same names and frames
        let files = m["files"]!.object!
        let front = try obj(m, "frontend", "frontend", optional: true)
        if (front == nil) != ((files["frontend"] ?? .null) == .null) {
            throw fail("frontend", "and files.frontend must be given together (a bundle with frontend.mlpackage has both)")
        }
        if let front {
            _ = try str(front, "compute_units", "frontend.compute_units", computeUnits, optional: true)
            _ = try str(front, "precision", "frontend.precision", precisions, optional: true)
            let feFunctions: JSONObject = try obj(front, "functions", "frontend.functions")
            if feFunctions.keys.sorted() != encFunctions.keys.sorted() {
                throw fail("frontend.functions", "are \(feFunctions.keys.sorted()) but encoder.functions are "
                           + "\(encFunctions.keys.sorted()): one front-end function per encoder window, same names")
            }
            for (name, fn) in feFunctions.entries {
                let path = "frontend.functions.\(name)"
                guard let f = fn.object else { throw fail(path, "must be an object, got \(fn.shown)") }
                let samples: Int = try int(f, "samples", "\(path).samples", lo: 1)
                let frames: Int = try int(f, "frames", "\(path).frames", lo: 1)
                _ = try num(f, "window_seconds", "\(path).window_seconds", 0, 3600, loOpen: true, optional: true)
                try equal("\(path).frames", frames, "encoder.functions.\(name).frames", framesOf[name]!)
                try equal("\(path).frames", frames, "the frames of \(path).samples with audio.n_fft and audio.hop_length",
                          (samples + 2 * (nFFT / 2) - nFFT) / hop)
                let block: JSONObject = try io(f, "io", "\(path).io")
                for (kind, name, dims, what) in [("inputs", "audio", [1, samples], "[1, \(path).samples]"),
                                                 ("inputs", "audio_length", [1], "[1]"),
                                                 ("outputs", "input_features", [1, nMels, frames], "[1, audio.n_mels, \(path).frames]"),
                                                 ("outputs", "feature_length", [1], "[1]")] {
                    try equal("\(path).io.\(kind).\(name).shape", try array(block, kind, name, "\(path).io").shape, what, shape(dims))
                }
            }
            _ = try io(front, "io", "frontend.io")
            try equal("frontend.io", front["io"]!, "frontend.functions.main.io", feFunctions["main"]!.object!["io"]!)
        }
        try checkVAD(m)

        // tokens, generation, languages (the prompts): ids inside the vocabulary, pieces as the tokenizer's
        let tokens: JSONObject = try obj(m, "tokens", "tokens")
        try equal("tokens.vocab_size", try int(tokens, "vocab_size", "tokens.vocab_size", lo: 1), "decoder.vocab_size", vocabSize)
        let eos: [Int] = try ints(tokens, "eos_token_ids", "tokens.eos_token_ids", hi: vocabSize - 1)
        guard let firstEOS = eos.first else { throw fail("tokens.eos_token_ids", "is empty: a decoder needs an end token") }
        try equal("tokens.eos_token_id", try int(tokens, "eos_token_id", "tokens.eos_token_id", hi: vocabSize - 1),
                  "tokens.eos_token_ids[0]", firstEOS)
        for key in ["pad_token_id", "bos_token_id", "decoder_start_token_id"] {
            _ = try int(tokens, key, "tokens.\(key)", hi: vocabSize - 1, optional: true)
        }
        let generation: JSONObject = try obj(m, "generation", "generation")
        _ = try str(generation, "strategy", "generation.strategy", ["greedy"])
        _ = try int(generation, "upstream_max_new_tokens", "generation.upstream_max_new_tokens", lo: 1, optional: true)
        let noSpace = generation["no_space_languages"]
        if noSpace != .array(noSpaceLanguages.map { .string($0) }) {
            throw fail("generation.no_space_languages", "is \((noSpace ?? .null).shown), expected \(noSpaceLanguages) "
                       + "(the languages whose windows are joined without a space)")
        }
        let prompts: JSONObject = try obj(m, "languages", "languages")
        if prompts.keys.sorted() != languages {
            throw fail("languages", "has prompts for \(prompts.keys.sorted().prefix(20)), expected one per language of the model: "
                       + languages.joined(separator: ", "))
        }
        var starts = Set<Int>()
        for (language, value) in prompts.entries {
            guard let both = value.object else { throw fail("languages.\(language)", "must be an object, got \(value.shown)") }
            for kind in ["punctuation", "no_punctuation"] {
                let path = "languages.\(language).\(kind)"
                let ids: [Int] = try ints(both, kind, path, hi: vocabSize - 1)
                try equal("\(path) (length)", ids.count, "decoder.prompt_length", promptLength)
                if let vocab {
                    let got = ids.map { vocab[String($0)] }
                    let want = promptTokens(language, punctuation: kind == "punctuation")
                    if got != want.map(Optional.some) {
                        throw fail(path, "decodes to \(got.map { $0 ?? "null" }) in files.vocab, expected the prompt \(want)")
                    }
                }
                starts.insert(ids[0])
            }
        }
        if let start = try int(tokens, "decoder_start_token_id", "tokens.decoder_start_token_id", hi: vocabSize - 1, optional: true),
           starts != [start] {
            throw fail("tokens.decoder_start_token_id", "is \(start) but the prompts in languages start with \(starts.sorted())")
        }
        if let vocab {
            for (key, piece) in [("pad_token_id", padToken), ("bos_token_id", bosToken)] {
                if let id = try int(tokens, key, "tokens.\(key)", hi: vocabSize - 1, optional: true), vocab[String(id)] != piece {
                    throw fail("tokens.\(key)", "is \(id), which files.vocab reads as \(vocab[String(id)] ?? "nothing"), not \(piece)")
                }
            }
            let missing = eos.filter { vocab[String($0)] == nil }
            if !missing.isEmpty { throw fail("tokens.eos_token_ids", "has ids \(missing) that files.vocab does not hold") }
            if vocab[String(firstEOS)] != eosToken {
                throw fail("tokens.eos_token_id", "is \(firstEOS), which files.vocab reads as \(vocab[String(firstEOS)] ?? "nothing"), "
                           + "not \(eosToken)")
            }
        }
    }
}
