import Foundation

/// Paths inside a bundle: what a manifest may name, and the check that nothing is reached through a
/// symbolic link (the Python side's `integrity.safe_path` and `bundle_files` rules).
public enum BundlePath {
    /// Why `path` (from a manifest) is not a plain normalised relative path inside the bundle, or nil.
    public static func unsafeReason(_ path: String) -> String? {
        if path.isEmpty { return "empty" }
        if path.hasPrefix("/") { return "absolute" }
        if path.count >= 2, path.dropFirst().first == ":", path.first!.isLetter { return "absolute (drive letter)" }
        if path.contains("\\") { return "contains a backslash" }
        if path.unicodeScalars.contains(where: { $0.value < 0x20 || $0.value == 0x7f }) { return "contains a control character" }
        if !path.unicodeScalars.elementsEqual(path.precomposedStringWithCanonicalMapping.unicodeScalars) {
            return "not in Unicode normal form C"
        }
        for component in path.split(separator: "/", omittingEmptySubsequences: false) {
            if component.isEmpty { return "has an empty component" }
            if component == ".." { return "has a '..' component" }
            if component == "." { return "has a '.' component" }
        }
        return nil
    }

    /// Throws when `relative` inside `bundle`, any folder on the way, anything inside it (for a folder
    /// such as an `.mlpackage`), or the bundle folder itself is a symbolic link.
    public static func checkNoSymbolicLinks(_ relative: String, in bundle: URL) throws {
        func isLink(_ url: URL) -> Bool {
            (try? url.resourceValues(forKeys: [.isSymbolicLinkKey]).isSymbolicLink) == true
        }
        if isLink(bundle) {
            throw BundleError.unsafePath("\(bundle.path) is a symbolic link: open the bundle folder itself")
        }
        var here = bundle
        for part in relative.split(separator: "/") {
            here = here.appendingPathComponent(String(part))
            if isLink(here) {
                throw BundleError.unsafePath("\(here.path) is a symbolic link, refused: a bundle holds regular files only")
            }
        }
        if let inside = FileManager.default.enumerator(at: here, includingPropertiesForKeys: [.isSymbolicLinkKey]) {
            for case let url as URL in inside where isLink(url) {
                throw BundleError.unsafePath("\(url.path) is a symbolic link, refused: a bundle holds regular files only")
            }
        }
    }
}

extension BundleError {
    /// The manifest field this error names (`invalidField`, or an unsafe `files` path), else nil.
    public var field: String? {
        switch self {
        case .invalidField(let field, _): return field
        case .unsafePath(let message) where message.hasPrefix("manifest files."):
            return message.dropFirst("manifest ".count).split(separator: " ", maxSplits: 1).first.map(String.init)
        default: return nil
        }
    }
}

/// Shape and element type of one input, output or state, as the manifest's `io` blocks list them.
public struct ArrayDescription: Codable, Equatable, Sendable, CustomStringConvertible {
    public var shape: [Int]
    public var dtype: String

    public init(shape: [Int], dtype: String) {
        self.shape = shape
        self.dtype = dtype
    }

    public var description: String { "\(dtype) \(shape)" }
}

/// Inputs, outputs and states of one package function.
public struct ModelIO: Codable, Equatable, Sendable {
    public var inputs: [String: ArrayDescription]
    public var outputs: [String: ArrayDescription]
    public var states: [String: ArrayDescription]

    public init(inputs: [String: ArrayDescription] = [:], outputs: [String: ArrayDescription] = [:],
                states: [String: ArrayDescription] = [:]) {
        self.inputs = inputs
        self.outputs = outputs
        self.states = states
    }

    public init(from decoder: Decoder) throws {
        let c = try decoder.container(keyedBy: CodingKeys.self)
        inputs = try c.decodeIfPresent([String: ArrayDescription].self, forKey: .inputs) ?? [:]
        outputs = try c.decodeIfPresent([String: ArrayDescription].self, forKey: .outputs) ?? [:]
        states = try c.decodeIfPresent([String: ArrayDescription].self, forKey: .states) ?? [:]
    }

    public var isEmpty: Bool { inputs.isEmpty && outputs.isEmpty && states.isEmpty }
}

/// `manifest.json` of a bundle (docs/bundle.md). Swift names are camelCase; `CodingKeys` map the JSON's snake_case.
public struct BundleManifest: Codable, Sendable {
    public static let formatName = "cohere-coreml-bundle"
    /// The `format_version` this package reads (3: the encoder takes its length masks from the host,
    /// `Encoder.lengthMasks`; 2: the decoder keeps the cross memory in its state; older formats are refused).
    public static let supportedFormatVersion = 3
    public static let fileName = "manifest.json"

    public struct Files: Codable, Sendable {
        public var encoder: String
        public var decoder: String
        public var vocab: String
        public var frontend: String?
        /// The voice-activity package (`vad.mlpackage`; nil: the bundle has none, manifest `vad` null).
        public var vad: String?
        /// An encoder in parts: the later programs' files, by `files` key (`encoder_part2`, ...; `Encoder.parts`
        /// names them). Empty for a whole encoder.
        public var encoderParts: [String: String] = [:]

        /// (manifest key, path) of every file named.
        public var named: [(String, String)] {
            [("encoder", encoder), ("decoder", decoder), ("vocab", vocab)] + (frontend.map { [("frontend", $0)] } ?? [])
                + (vad.map { [("vad", $0)] } ?? [])
                + encoderParts.sorted { $0.key < $1.key }.map { ($0.key, $0.value) }
        }

        /// The file a `files` key names (the encoder, decoder, vocabulary, front end or an encoder part).
        public func file(forKey key: String) -> String? {
            switch key {
            case "encoder": return encoder
            case "decoder": return decoder
            case "vocab": return vocab
            case "frontend": return frontend
            case "vad": return vad
            default: return encoderParts[key]
            }
        }

        public init(encoder: String, decoder: String, vocab: String, frontend: String? = nil, vad: String? = nil,
                    encoderParts: [String: String] = [:]) {
            (self.encoder, self.decoder, self.vocab, self.frontend, self.encoderParts) = (encoder, decoder, vocab, frontend, encoderParts)
            self.vad = vad
        }

        struct Key: CodingKey {
            var stringValue: String
            var intValue: Int? { nil }
            init(stringValue: String) { self.stringValue = stringValue }
            init?(intValue: Int) { nil }
        }

        public init(from decoder: Swift.Decoder) throws {
            let c = try decoder.container(keyedBy: Key.self)
            encoder = try c.decode(String.self, forKey: Key(stringValue: "encoder"))
            self.decoder = try c.decode(String.self, forKey: Key(stringValue: "decoder"))
            vocab = try c.decode(String.self, forKey: Key(stringValue: "vocab"))
            frontend = try c.decodeIfPresent(String.self, forKey: Key(stringValue: "frontend"))
            vad = try c.decodeIfPresent(String.self, forKey: Key(stringValue: "vad"))
            for key in c.allKeys where key.stringValue.hasPrefix("encoder_part") {
                encoderParts[key.stringValue] = try c.decode(String.self, forKey: key)
            }
        }

        public func encode(to encoder: Swift.Encoder) throws {
            var c = encoder.container(keyedBy: Key.self)
            try c.encode(self.encoder, forKey: Key(stringValue: "encoder"))
            try c.encode(decoder, forKey: Key(stringValue: "decoder"))
            try c.encode(vocab, forKey: Key(stringValue: "vocab"))
            try c.encodeIfPresent(frontend, forKey: Key(stringValue: "frontend"))
            try c.encodeIfPresent(vad, forKey: Key(stringValue: "vad"))
            for (key, file) in encoderParts { try c.encode(file, forKey: Key(stringValue: key)) }
        }
    }

    public struct Audio: Codable, Sendable {
        public var samplingRate: Int
        public var nFFT: Int
        public var winLength: Int
        public var hopLength: Int
        public var nMels: Int
        public var maxAudioClipSeconds: Double
        public var overlapChunkSeconds: Double
        public var minEnergyWindowSamples: Int
        public var windowFrames: Int
        enum CodingKeys: String, CodingKey {
            case samplingRate = "sampling_rate"
            case nFFT = "n_fft"
            case winLength = "win_length"
            case hopLength = "hop_length"
            case nMels = "n_mels"
            case maxAudioClipSeconds = "max_audio_clip_s"
            case overlapChunkSeconds = "overlap_chunk_second"
            case minEnergyWindowSamples = "min_energy_window_samples"
            case windowFrames = "window_frames"
        }
    }

    public struct EncoderFunction: Codable, Sendable {
        public var frames: Int
        public var windowSeconds: Double?
        /// This function's inputs/outputs, read from the package at export time.
        public var io: ModelIO?
        enum CodingKeys: String, CodingKey {
            case frames
            case windowSeconds = "window_seconds"
            case io
        }
    }

    /// The encoder's length-mask rule (Python's `shapes.LengthMasks`): the encoder program computes no
    /// lengths; the host passes one float16 0/1 mask per time resolution, `names[k]` of shape (1, frames_k)
    /// holding L_k ones, with L_0 the valid mel frames and L_k = (L_k-1 + 2 * padding - kernelSize) / stride + 1
    /// (floor division); the same rule applied to a window's frames gives the masks' sizes. L_S is the
    /// window's encoder length.
    public struct LengthMasks: Codable, Sendable, Equatable {
        public var kernelSize: Int
        public var stride: Int
        public var padding: Int
        public var stages: Int
        enum CodingKeys: String, CodingKey {
            case kernelSize = "kernel_size"
            case stride, padding, stages
        }

        /// Input names, mel frames first, encoder frames last.
        public var names: [String] {
            ["feature_mask"] + (stages > 1 ? (1..<stages).map { "subsampling_mask_\($0)" } : []) + ["encoder_mask"]
        }

        /// [L_0 = n, L_1, ..., L_S].
        public func lengths(_ n: Int) -> [Int] {
            var out = [n]
            for _ in 0..<stages {
                let x = out[out.count - 1] + 2 * padding - kernelSize
                out.append((x >= 0 ? x / stride : -((-x + stride - 1) / stride)) + 1)  // floor division, as Python's //
            }
            return out
        }

        /// The masks (float16 0/1, (1, frames_k)) of `validFrames` valid mel frames in a window of `frames`.
        public func tensors(validFrames: Int, frames: Int) throws -> [String: Tensor] {
            guard (1...max(frames, 1)).contains(validFrames) else {
                throw TranscriptionError.invalidArgument("\(validFrames) valid mel frames do not fit an encoder window of \(frames)")
            }
            var out: [String: Tensor] = [:]
            for (name, (size, valid)) in zip(names, zip(lengths(frames), lengths(validFrames))) {
                let ones = max(0, min(valid, size))
                let bits = [UInt16](repeating: 0x3C00, count: ones) + [UInt16](repeating: 0, count: size - ones)  // 1.0, 0.0
                out[name] = try Tensor(dtype: .float16, shape: [1, size], data: bits.withUnsafeBufferPointer { Data(buffer: $0) })
            }
            return out
        }

        /// The window's encoder length for `validFrames` valid mel frames.
        public func encoderLength(validFrames: Int) -> Int { lengths(validFrames).last ?? 0 }
    }

    /// One program of the encoder: consecutive layers `layers[0] ..< layers[1]`, in the file `files[file]`,
    /// with every function of `Encoder.functions` (its own I/O). The first takes the features and the
    /// length masks, each next one the previous part's `hidden_states` and the `encoder_mask`; the last gives
    /// the cross memory.
    public struct EncoderPart: Codable, Sendable {
        public struct Function: Codable, Sendable { public var io: ModelIO? }
        public var file: String
        public var layers: [Int]
        public var functions: [String: Function]
    }

    public struct Encoder: Codable, Sendable {
        public var windowFrames: Int
        public var memoryLength: Int
        public var numMelBins: Int
        public var lengthMasks: LengthMasks
        /// The encoder's programs in order (one: the whole encoder; `cohere-coreml export --encoder-parts`).
        public var parts: [EncoderPart]
        public var functions: [String: EncoderFunction]?
        public var io: ModelIO?
        enum CodingKeys: String, CodingKey {
            case windowFrames = "window_frames"
            case memoryLength = "memory_len"
            case numMelBins = "num_mel_bins"
            case lengthMasks = "length_masks"
            case parts
            case functions
            case io
        }
    }

    public struct DecoderFunctions: Codable, Sendable {
        public var step: String
        public var prefill: String?
        /// Format 2: the function that writes the encoder's cross memory into the state, once per window.
        public var bind: String?
        /// Optional: up to `extendLength` tokens from a given cache slot in one call (forced prefixes).
        public var extend: String?
        /// Optional (host-state decoder): one token for each of `Decoder.batch.size` windows a call, on a state of
        /// its own (`decoder.batch`; docs/bundle.md, "Decoding several windows at once").
        public var stepBatch: String?
        enum CodingKeys: String, CodingKey {
            case step, prefill, bind, extend
            case stepBatch = "step_batch"
        }
    }

    /// `decoder.batch`: the batched step's rows and io (a host-state decoder exported with `--decoder-batch B`).
    public struct DecoderBatch: Codable, Sendable, Equatable {
        /// B, the windows of one call; the function's states hold B rows, folded into the head axis.
        public var size: Int
        /// The function's inputs, outputs and states, read from the package at export time.
        public var io: ModelIO?
    }

    /// `decoder.alignment` (docs/word-timings.md, docs/decoder.md): the decoder package's `align` function, which
    /// returns the cross-attention weights of the alignment heads for a window's tokens after its decoding
    /// (`length` tokens a call, on the decoded state), and what the word-timing rule needs with them.
    public struct Alignment: Codable, Sendable, Equatable {
        /// The function's name in the decoder package.
        public var function: String
        /// K, the tokens of one call (the extend length): a window's prompt and text tokens go K a call.
        public var length: Int
        /// The alignment heads, [layer, head] each, in the order of the output's head axis.
        public var heads: [[Int]]
        /// Rows before the text the rule reads (the rows predicting the prompt's last `leadRows` tokens).
        public var leadRows: Int
        /// One encoder frame in seconds.
        public var frameSeconds: Double
        /// The function's inputs, outputs and states, read from the package at export time.
        public var io: ModelIO?

        public init(function: String, length: Int, heads: [[Int]], leadRows: Int, frameSeconds: Double,
                    io: ModelIO? = nil) {
            (self.function, self.length, self.heads, self.leadRows, self.frameSeconds, self.io) =
                (function, length, heads, leadRows, frameSeconds, io)
        }

        enum CodingKeys: String, CodingKey {
            case function, length, heads, io
            case leadRows = "lead_rows"
            case frameSeconds = "frame_seconds"
        }
    }

    /// A manifest field read without refusing the manifest (the Python loader does not check it): its value,
    /// or why it is unreadable, said when it is used.
    struct Lenient<Value: Codable & Sendable>: Codable, Sendable {
        var value: Value?
        var problem: String?

        init(value: Value?) { self.value = value }

        init(from decoder: Swift.Decoder) throws {
            do {
                value = try Value(from: decoder)
            } catch let DecodingError.keyNotFound(key, context) {
                problem = "has no field '\((context.codingPath.map(\.stringValue) + [key.stringValue]).joined(separator: "."))'"
            } catch let DecodingError.typeMismatch(_, context) {
                problem = "has the wrong type at '\(context.codingPath.map(\.stringValue).joined(separator: "."))'"
            } catch {
                problem = "is unreadable"
            }
        }

        func encode(to encoder: Swift.Encoder) throws { try value.encode(to: encoder) }
    }

    public struct Decoder: Codable, Sendable {
        public var capacity: Int
        public var promptLength: Int
        public var maxNewTokens: Int
        public var vocabSize: Int
        public var cacheShape: [Int]
        public var memoryShape: [Int]
        public var output: String
        public var functions: DecoderFunctions?
        public var prefillLength: Int?
        /// K, the tokens of one extend call (nil without extend).
        public var extendLength: Int?
        /// The step function's inputs/outputs/states, read from the package at export time.
        public var io: ModelIO?
        /// The prefill function's (nil without prefill).
        public var prefillIO: ModelIO?
        /// The extend function's (nil without extend).
        public var extendIO: ModelIO?
        /// The bind function's (format 2).
        public var bindIO: ModelIO?
        /// Format 2: bind function input -> the encoder output it takes unchanged
        /// (e.g. "encoder_cross_k" -> "cross_k"; an input cannot share the name of the state it fills).
        public var bindInputs: [String: String]?
        /// Who writes the decoder state: "graph" (the functions; the bind function the memory; absent: graph)
        /// or "host" (the functions only read it; the app writes the memory once per window and each call's
        /// new K/V rows, through `MLState.withMultiArray(for:)`).
        public var stateWrites: String?
        /// Host-state decoder: state -> the encoder output written into it once per window.
        public var memoryStates: [String: String]?
        /// Host-state decoder: state -> the output of each call's new rows (L, Hkv, S, Dh), written at its slots.
        public var rowOutputs: [String: String]?
        /// Host-state decoder: the fp16 (1, 1, 1, C) input, 0 for the filled cache slots, -1e4 for the others.
        public var cacheMaskInput: String?
        /// The batched step's rows and io (nil: the decoder has no `step_batch`).
        public var batch: DecoderBatch?
        /// True when the app writes the decoder state (`stateWrites` "host").
        public var hostWritesState: Bool { stateWrites == "host" }
        var alignmentField: Lenient<Alignment>?
        var alignmentNoteField: Lenient<String>?
        /// Word timings: the align function and what the rule needs (nil: the bundle has none, or the block is
        /// unreadable; `checkedAlignment(promptLength:)` says which).
        public var alignment: Alignment? { alignmentField?.value }
        /// Why the bundle has no alignment (e.g. "exported with --alignment-heads none"), nil when it has one.
        public var alignmentNote: String? { alignmentNoteField?.value }
        enum CodingKeys: String, CodingKey {
            case capacity
            case promptLength = "prompt_length"
            case maxNewTokens = "max_new_tokens"
            case vocabSize = "vocab_size"
            case cacheShape = "cache_shape"
            case memoryShape = "memory_shape"
            case output
            case functions
            case prefillLength = "prefill_length"
            case extendLength = "extend_length"
            case io
            case prefillIO = "prefill_io"
            case extendIO = "extend_io"
            case bindIO = "bind_io"
            case bindInputs = "bind_inputs"
            case stateWrites = "state_writes"
            case memoryStates = "memory_states"
            case rowOutputs = "row_outputs"
            case cacheMaskInput = "cache_mask_input"
            case batch
            case alignmentField = "alignment"
            case alignmentNoteField = "alignment_note"
        }
    }

    /// One function (window) of the front-end package.
    public struct FrontEndFunction: Codable, Sendable {
        public var samples: Int
        public var frames: Int
        public var windowSeconds: Double?
        public var io: ModelIO?
        enum CodingKeys: String, CodingKey {
            case samples
            case frames
            case windowSeconds = "window_seconds"
            case io
        }
    }

    /// The front-end package section (written when the bundle has `frontend.mlpackage`): one function
    /// per encoder window, samples in, the encoder's `input_features` out.
    public struct FrontEnd: Codable, Sendable {
        public var functions: [String: FrontEndFunction]
        public var io: ModelIO?
        public var computeUnits: String?
        enum CodingKeys: String, CodingKey {
            case functions
            case io
            case computeUnits = "compute_units"
        }
    }

    /// The voice-activity section (written when the bundle has `vad.mlpackage`; docs/vad.md): Silero VAD's
    /// 16 kHz network, its two functions (`block`: `chunks` rows a call for whole signals; `chunk`: one, for
    /// streams) with their io, and the numbers the host frames the audio with.
    public struct VAD: Codable, Sendable {
        public struct Function: Codable, Sendable {
            /// Rows (512-sample chunks) of one call: N for `block` (chosen at export), 1 for `chunk`.
            public var chunks: Int
            public var io: ModelIO?
        }
        public var sampleRate: Int
        public var chunkSamples: Int
        public var contextSamples: Int
        public var hidden: Int
        /// The functions the check reads (`block`, `chunk`); other entries are ignored, as Python ignores them.
        public var functions: [String: Function]
        /// Where the package's predictions run (`ComputeUnits` raw value; informational, read leniently).
        public var computeUnits: String?

        public init(sampleRate: Int = 16000, chunkSamples: Int = 512, contextSamples: Int = 64, hidden: Int = 128,
                    functions: [String: Function], computeUnits: String? = nil) {
            (self.sampleRate, self.chunkSamples, self.contextSamples, self.hidden) = (sampleRate, chunkSamples, contextSamples, hidden)
            (self.functions, self.computeUnits) = (functions, computeUnits)
        }

        enum CodingKeys: String, CodingKey {
            case hidden, functions
            case sampleRate = "sample_rate"
            case chunkSamples = "chunk_samples"
            case contextSamples = "context_samples"
            case computeUnits = "compute_units"
        }

        public init(from decoder: Swift.Decoder) throws {
            let c = try decoder.container(keyedBy: CodingKeys.self)
            sampleRate = try c.decode(Int.self, forKey: .sampleRate)
            chunkSamples = try c.decode(Int.self, forKey: .chunkSamples)
            contextSamples = try c.decode(Int.self, forKey: .contextSamples)
            hidden = try c.decode(Int.self, forKey: .hidden)
            let all = try c.decode([String: Lenient<Function>].self, forKey: .functions)
            functions = all.compactMapValues(\.value)
            computeUnits = (try? c.decodeIfPresent(Lenient<String>.self, forKey: .computeUnits))??.value
        }
    }

    public struct Tokens: Codable, Sendable {
        public var eosTokenIds: [Int]
        public var vocabSize: Int
        enum CodingKeys: String, CodingKey {
            case eosTokenIds = "eos_token_ids"
            case vocabSize = "vocab_size"
        }
    }

    public struct Generation: Codable, Sendable {
        public var strategy: String
        public var noSpaceLanguages: [String]
        enum CodingKeys: String, CodingKey {
            case strategy
            case noSpaceLanguages = "no_space_languages"
        }
    }

    public struct Prompts: Codable, Sendable {
        public var punctuation: [Int]
        public var noPunctuation: [Int]
        enum CodingKeys: String, CodingKey {
            case punctuation
            case noPunctuation = "no_punctuation"
        }
    }

    public var format: String
    public var formatVersion: Int
    public var modelId: String?
    public var precision: String?
    public var files: Files
    public var audio: Audio
    public var encoder: Encoder
    public var decoder: Decoder
    public var frontend: FrontEnd?
    /// The voice-activity package's section (nil: the bundle has none).
    public var vad: VAD?
    public var tokens: Tokens
    public var generation: Generation
    public var languages: [String: Prompts]

    enum CodingKeys: String, CodingKey {
        case format
        case formatVersion = "format_version"
        case modelId = "model_id"
        case precision, files, audio, encoder, decoder, frontend, vad, tokens, generation, languages
    }

    /// Decodes `data` after the Python loader's checks (`ManifestCheck`, in its order): another format, a
    /// newer or older `format_version`, an unsafe file path, then every field's type, range and
    /// consistency, each refusal a `BundleError` naming the field. With `bundle` (the folder the manifest
    /// describes) also what needs its files: every named file present, the `checksums` sizes, the
    /// prompts and token ids against `vocab.json`, the audio settings against `processor_config.json`.
    public static func decode(_ data: Data, bundle: URL? = nil) throws -> BundleManifest {
        let document: JSONValue
        do {
            document = try JSONValue.parse(data)
        } catch {
            throw BundleError.unreadableManifest("not JSON: \(error)")
        }
        guard var object = document.object else {
            throw BundleError.unsupportedFormat("manifest is not a JSON object, expected a '\(formatName)' manifest")
        }
        try ManifestCheck.checkHeaderAndFiles(object, bundle: bundle)
        try ManifestCheck.checkChecksums(object, bundle: bundle)
        let read = try bundle.map { try ManifestCheck.readVocabAndProcessor(object, bundle: $0) }
        try ManifestCheck.checkManifest(object, vocab: read?.vocab, processor: read?.processor)
        // Fields the checks leave optional, as the types below read them: audio.window_frames is
        // encoder.window_frames (checked equal when given); model_id is informational (a string or absent).
        if var audio = object["audio"]?.object, (audio["window_frames"] ?? .null) == .null {
            audio["window_frames"] = object["encoder"]!.object!["window_frames"]
            object["audio"] = .object(audio)
        }
        if let id = object["model_id"], case .string = id {} else { object["model_id"] = nil }
        do {
            // standard JSON of the checked document (a non-finite number or one beyond 64 bits is null:
            // only fields nothing reads can hold one)
            return try JSONDecoder().decode(BundleManifest.self, from: Data(JSONValue.object(object).jsonText().utf8))
        } catch let DecodingError.keyNotFound(key, context) {
            throw BundleError.unreadableManifest(
                "missing field '\((context.codingPath.map(\.stringValue) + [key.stringValue]).joined(separator: "."))'")
        } catch let DecodingError.typeMismatch(_, context) {
            throw BundleError.unreadableManifest(
                "wrong type at '\(context.codingPath.map(\.stringValue).joined(separator: "."))'")
        } catch {
            throw BundleError.unreadableManifest("\(error)")
        }
    }

    /// Reads `manifest.json` from a bundle folder.
    public static func load(bundle: URL) throws -> BundleManifest {
        let url = bundle.appendingPathComponent(fileName)
        guard FileManager.default.fileExists(atPath: url.path) else {
            throw BundleError.missingFile("no \(fileName) in \(bundle.path): export the bundle with `cohere-coreml export`")
        }
        return try decode(try Data(contentsOf: url), bundle: bundle)
    }

    /// The decoder prompt of `language`.
    public func prompt(language: String, punctuation: Bool = true) throws -> [Int] {
        guard let prompts = languages[language] else {
            throw BundleError.unknownLanguage(language, available: languages.keys.sorted())
        }
        return punctuation ? prompts.punctuation : prompts.noPunctuation
    }

    /// Encoder functions (frames, name), smallest window first.
    public var encoderBuckets: [(frames: Int, function: String)] {
        let functions = encoder.functions ?? ["main": EncoderFunction(frames: encoder.windowFrames, windowSeconds: nil)]
        return functions.map { (frames: $0.value.frames, function: $0.key) }
            .sorted { ($0.frames, $0.function) < ($1.frames, $1.function) }
    }

    /// The I/O the manifest lists for a function of a component (nil when the manifest has none).
    public func listedIO(component: String, function: String) -> ModelIO? {
        let io: ModelIO?
        switch component {
        case _ where encoder.parts.count > 1 && encoder.parts.contains(where: { $0.file == component }):
            io = encoder.parts.first { $0.file == component }?.functions[function]?.io
        case "encoder": io = encoder.functions?[function]?.io ?? (function == "main" ? encoder.io : nil)
        case "decoder":
            if function == decoder.functions?.prefill { io = decoder.prefillIO }
            else if function == decoder.functions?.extend { io = decoder.extendIO }
            else if function == decoder.functions?.bind { io = decoder.bindIO }
            else if let a = decoder.alignment, function == a.function { io = a.io }
            else if function == decoder.functions?.stepBatch { io = decoder.batch?.io }
            else { io = function == (decoder.functions?.step ?? "main") ? decoder.io : nil }
        case "frontend": io = frontend?.functions[function]?.io ?? (function == "main" ? frontend?.io : nil)
        case "vad": io = vad?.functions[function]?.io
        default: io = nil
        }
        return io.flatMap { $0.isEmpty ? nil : $0 }
    }

    /// The front-end function of the smallest window that holds `samples` samples and gives at least
    /// `frames` mel frames (Python's `shapes.choose_frontend_function`).
    public func frontEndFunction(samples: Int, frames: Int) -> (function: String, samples: Int, frames: Int)? {
        (frontend?.functions ?? [:])
            .filter { $0.value.samples >= samples && $0.value.frames >= frames }
            .map { (function: $0.key, samples: $0.value.samples, frames: $0.value.frames) }
            .min { ($0.samples, $0.function) < ($1.samples, $1.function) }
    }

    // MARK: - Package I/O expected by the manifest

    /// What one encoder function must take and return (docs/contract.md), from the manifest's sizes.
    public func expectedEncoderIO(frames: Int) -> ModelIO {
        let memory = decoder.memoryShape
        var inputs: [String: ArrayDescription] = ["input_features": .init(shape: [1, encoder.numMelBins, frames], dtype: "float32")]
        let masks = encoder.lengthMasks
        for (name, size) in zip(masks.names, masks.lengths(frames)) { inputs[name] = .init(shape: [1, size], dtype: "float16") }
        return ModelIO(
            inputs: inputs,
            outputs: ["cross_k": .init(shape: memory, dtype: programFloat),
                      "cross_v": .init(shape: memory, dtype: programFloat),
                      "cross_mask": .init(shape: [1, 1, 1, encoder.memoryLength], dtype: programFloat)])
    }

    /// What part `index` of the encoder takes and returns for a function of `frames` mel frames: the first
    /// the features and length masks, a later one the hidden state and the encoder mask; the last the cross
    /// memory, an earlier one its hidden state (only its frame count is fixed by the manifest's sizes here; the
    /// exact shapes are the part's `io` block).
    public func expectedEncoderPartIO(index: Int, frames: Int) -> ModelIO {
        let whole = expectedEncoderIO(frames: frames)
        let encoderFrames = encoder.lengthMasks.lengths(frames).last ?? 0
        let inputs = index == 0 ? whole.inputs : ["encoder_mask": .init(shape: [1, encoderFrames], dtype: "float16")]
        let outputs = index == encoder.parts.count - 1 ? whole.outputs : [:]
        return ModelIO(inputs: inputs, outputs: outputs)
    }

    var crossMemoryArrays: [String: ArrayDescription] {
        ["cross_k": .init(shape: decoder.memoryShape, dtype: programFloat),
         "cross_v": .init(shape: decoder.memoryShape, dtype: programFloat),
         "cross_mask": .init(shape: [1, 1, 1, encoder.memoryLength], dtype: programFloat)]
    }

    /// The decoder state every function shares: the KV cache and the window's cross memory (fp16).
    var decoderStates: [String: ArrayDescription] {
        var states: [String: ArrayDescription] = ["self_k": .init(shape: decoder.cacheShape, dtype: "float16"),
                                                  "self_v": .init(shape: decoder.cacheShape, dtype: "float16")]
        for (name, a) in crossMemoryArrays { states[name] = .init(shape: a.shape, dtype: "float16") }
        return states
    }

    /// What the decoder step (or, with `prefillLength`, the prefill function) must take and return: only
    /// the token(s) and position, whatever the audio length (the cross memory is in the state).
    public func expectedDecoderIO(prefillLength: Int? = nil) -> ModelIO {
        var inputs: [String: ArrayDescription] = ["input_ids": .init(shape: [1, prefillLength ?? 1], dtype: "int32")]
        if prefillLength == nil { inputs["position"] = .init(shape: [1], dtype: "int32") }
        if prefillLength == nil, let mask = hostCacheMask { inputs[mask.name] = mask.array }
        return ModelIO(inputs: inputs,
                       outputs: hostRowOutputs(tokens: prefillLength ?? 1)
                           .merging([decoder.output: .init(shape: [1, decoder.vocabSize], dtype: programFloat)]) { a, _ in a },
                       states: decoderStates)
    }

    /// What the batched step must take and return (`decoder.batch`; nil without one): the step's arrays with B rows,
    /// the states' rows folded into the head axis (docs/bundle.md, "Decoding several windows at once").
    public func expectedBatchDecoderIO() -> ModelIO? {
        guard let b = decoder.batch?.size, b >= 1, decoder.hostWritesState else { return nil }
        let c = decoder.cacheShape, m = decoder.memoryShape
        guard c.count == 4, m.count == 4 else { return nil }
        let rows = [c[0], b * c[1]]
        return ModelIO(
            inputs: ["input_ids": .init(shape: [b, 1], dtype: "int32"), "position": .init(shape: [b], dtype: "int32"),
                     decoder.cacheMaskInput ?? "cache_mask": .init(shape: [b, 1, 1, decoder.capacity], dtype: "float16")],
            outputs: [decoder.output: .init(shape: [b, decoder.vocabSize], dtype: programFloat),
                      "new_k": .init(shape: rows + [1, c[3]], dtype: "float16"),
                      "new_v": .init(shape: rows + [1, c[3]], dtype: "float16")],
            states: ["self_k": .init(shape: rows + [c[2], c[3]], dtype: "float16"),
                     "self_v": .init(shape: rows + [c[2], c[3]], dtype: "float16"),
                     "cross_k": .init(shape: rows + [m[2], m[3]], dtype: "float16"),
                     "cross_v": .init(shape: rows + [m[2], m[3]], dtype: "float16"),
                     "cross_mask": .init(shape: [b, 1, 1, encoder.memoryLength], dtype: "float16")])
    }

    /// A host-state decoder's cache-mask input (nil for a graph-state one).
    var hostCacheMask: (name: String, array: ArrayDescription)? {
        guard decoder.hostWritesState else { return nil }
        return (decoder.cacheMaskInput ?? "cache_mask", .init(shape: [1, 1, 1, decoder.capacity], dtype: "float16"))
    }

    /// A host-state decoder call's new-row outputs for `tokens` tokens (empty for a graph-state one).
    func hostRowOutputs(tokens: Int) -> [String: ArrayDescription] {
        guard decoder.hostWritesState else { return [:] }
        let c = decoder.cacheShape
        var out: [String: ArrayDescription] = [:]
        for (_, output) in decoder.rowOutputs ?? [:] {
            out[output] = .init(shape: [c[0], c[1], tokens, c[3]], dtype: "float16")
        }
        return out
    }

    /// What the extend function must take and return: `extendLength` token ids and the first one's slot; the
    /// log-probs after each of the K slots.
    public func expectedExtendIO(extendLength: Int) -> ModelIO {
        var inputs: [String: ArrayDescription] = ["input_ids": .init(shape: [1, extendLength], dtype: "int32"),
                                                  "position": .init(shape: [1], dtype: "int32")]
        if let mask = hostCacheMask { inputs[mask.name] = mask.array }
        return ModelIO(inputs: inputs,
                       outputs: hostRowOutputs(tokens: extendLength)
                           .merging([decoder.output: .init(shape: [1, extendLength, decoder.vocabSize], dtype: programFloat)]) { a, _ in a },
                       states: decoderStates)
    }

    /// What the bind function must take (the encoder's cross memory, under its `bind_inputs` names) and
    /// hold (format 2).
    public func expectedBindIO() -> ModelIO {
        let memory = crossMemoryArrays
        var inputs: [String: ArrayDescription] = [:]
        for (input, output) in decoder.bindInputs ?? [:] { inputs[input] = memory[output] }
        return ModelIO(inputs: inputs, outputs: [:], states: decoderStates)
    }

    /// The align function's output: the alignment heads' weights, (1, heads, length, encoder frames).
    public static let alignOutput = "cross_attention"

    /// What the align function must take (the host-state extend's inputs: `length` token ids, the first one's
    /// slot, the mask of the slots before it, in either state variant), return (the heads' weights) and hold.
    public func expectedAlignIO(_ alignment: Alignment) -> ModelIO {
        ModelIO(inputs: ["input_ids": .init(shape: [1, alignment.length], dtype: "int32"),
                         "position": .init(shape: [1], dtype: "int32"),
                         "cache_mask": .init(shape: [1, 1, 1, decoder.capacity], dtype: "float16")],
                outputs: [Self.alignOutput: .init(shape: [1, alignment.heads.count, alignment.length, encoder.memoryLength],
                                                  dtype: "float16")],
                states: ["cross_k": .init(shape: decoder.memoryShape, dtype: "float16"),
                         "cross_v": .init(shape: decoder.memoryShape, dtype: "float16")])
    }

    /// The bundle's alignment for word timings with a prompt of `promptLength` tokens, checked; else a one-line
    /// error naming the fix (a bundle without alignment, an unreadable or inconsistent `decoder.alignment`).
    public func checkedAlignment(promptLength: Int) throws -> Alignment {
        if let problem = decoder.alignmentField?.problem {
            throw BundleError.invalidField(field: "decoder.alignment", problem: "\(problem): re-export the bundle")
        }
        guard let a = decoder.alignment else {
            throw TranscriptionError.invalidArgument(
                "word timings: this bundle has no word alignment (\(decoder.alignmentNote ?? "no decoder.alignment in its manifest")): "
                    + "export it with `cohere-coreml export --alignment-heads auto`")
        }
        func invalid(_ field: String, _ problem: String) -> BundleError {
            .invalidField(field: "decoder.alignment.\(field)", problem: "\(problem): re-export the bundle")
        }
        guard (1...decoder.capacity).contains(a.length) else {
            throw invalid("length", "is \(a.length), outside [1, \(decoder.capacity)] (the cache capacity)")
        }
        guard !a.heads.isEmpty, a.heads.allSatisfy({ $0.count == 2 }) else {
            throw invalid("heads", "must be a non-empty list of [layer, head] pairs")
        }
        guard (0..<max(promptLength, 1)).contains(a.leadRows) else {
            throw invalid("lead_rows", "is \(a.leadRows), outside 0...\(promptLength - 1) for a prompt of \(promptLength) tokens")
        }
        guard a.frameSeconds.isFinite, a.frameSeconds > 0 else { throw invalid("frame_seconds", "must be a positive number") }
        return a
    }

    /// What one front-end function of a window of `samples` samples and `frames` mel frames must take and return.
    public func expectedFrontEndIO(samples: Int, frames: Int) -> ModelIO {
        ModelIO(inputs: ["audio": .init(shape: [1, samples], dtype: "float32"),
                         "audio_length": .init(shape: [1], dtype: "int32")],
                outputs: ["input_features": .init(shape: [1, encoder.numMelBins, frames], dtype: "float32"),
                          "feature_length": .init(shape: [1], dtype: "int32")])
    }

    var programFloat: String { precision == "fp32" ? "float32" : "float16" }
}

/// Checks a loaded function's I/O: every array `expected` names must be there with that shape and
/// dtype (`exact`: and nothing else). Throws `BundleError.ioMismatch` naming the first difference.
func checkIO(_ actual: ModelIO, expected: ModelIO, exact: Bool, component: String, function: String) throws {
    for (kind, want, got) in [("input", expected.inputs, actual.inputs), ("output", expected.outputs, actual.outputs),
                              ("state", expected.states, actual.states)] {
        for name in want.keys.sorted() {
            guard let have = got[name] else {
                throw BundleError.ioMismatch(component: component, function: function,
                                             detail: "no \(kind) '\(name)' (has: \(got.keys.sorted().joined(separator: ", ")))")
            }
            if have != want[name]! {
                throw BundleError.ioMismatch(component: component, function: function,
                                             detail: "\(kind) '\(name)' is \(have), the manifest says \(want[name]!)")
            }
        }
        if exact, let extra = got.keys.sorted().first(where: { want[$0] == nil }) {
            throw BundleError.ioMismatch(component: component, function: function,
                                         detail: "\(kind) '\(extra)' is not in the manifest")
        }
    }
}
