import Foundation

/// Why a window's decoding stopped (Python's stop reasons).
public enum StopReason: String, Sendable, Codable, CaseIterable {
    /// The model emitted an end-of-sequence token: the window is complete.
    case eos
    /// `maxNewTokens` tokens were emitted.
    case maxNewTokens = "max_new_tokens"
    /// The decoder's cache is full.
    case capacity
}

/// One window's result (the Python `WindowResult`).
public struct WindowResult: Sendable, Codable {
    public var index: Int
    public var startSeconds: Double
    public var durationSeconds: Double
    /// Generated ids (prompt excluded; the eos id included when reached).
    public var tokenIds: [Int]
    public var text: String
    /// True when the window stopped without eos.
    public var truncated: Bool
    public var stopReason: StopReason
    public var timings: WindowTimings
    /// The window's words with their times on the audio's timeline and probabilities (nil: not asked).
    public var words: [WordTiming]? = nil
}

/// Warm-call timings of one window, in seconds (model loading and compiling are in `loadSeconds`).
public struct WindowTimings: Sendable, Codable {
    public var featuresSeconds: Double
    public var encoderSeconds: Double
    public var encoderFunction: String
    /// Binding the window's cross memory into the decoder state (one bind call per window).
    public var bindSeconds: Double
    public var promptSeconds: Double
    public var decodeSeconds: Double
    /// Decoder calls of the prompt and the generated tokens (the bind call not counted).
    public var decoderCalls: Int
    public var msPerDecoderCall: Double
    /// Token slots those calls computed (prefill P, extend K with its padding, step 1): the decoder's compute.
    public var decoderTokensFed: Int = 0
    /// Bytes the app wrote into the decoder state (a host-state decoder, `decoder.state_writes` "host": the
    /// window's cross memory once, then each call's new K/V rows; 0 for a graph-state decoder).
    public var decoderStateBytesWritten: Int = 0
    /// Word timings: the align call and the word-timing rule (0 when not asked).
    public var alignSeconds: Double = 0
    /// Windows of the batched calls that decoded this one (`decoder.batch.size`; 1: the batch-1 loop).
    public var decoderBatch: Int = 1
}

/// One decoder call of a `FeedPlan`: `function` feeding ids [offset, offset + count) of a prefix at cache slot
/// start + offset; `fed` token slots computed (prefill P, extend K including its padding, step 1).
public struct FeedCall: Sendable, Equatable {
    public enum Function: String, Sendable { case prefill, extend, step }
    public var function: Function
    public var offset: Int
    public var count: Int
    public var fed: Int
}

/// How a forced prefix is fed to the decoder (Python's `decoder_runtime.feed_plan`): the bare prompt (slot 0,
/// exactly `prefillLength` tokens) by one prefill call when only the log-probs after its last token are read
/// (`rowsFrom`: the first token whose log-probs the caller reads, default the last; a prefill call returns no
/// others); else extend calls of up to K tokens while at least 2 remain and the call's K slots fit the cache;
/// the rest one step per token (no prefill / extend: steps only).
public func feedPlan(count: Int, start: Int, capacity: Int, prefillLength: Int?, extendLength: Int?,
                     rowsFrom: Int? = nil) -> [FeedCall] {
    if start == 0, let prefillLength, count == prefillLength, (rowsFrom ?? count - 1) >= count - 1 {
        return [FeedCall(function: .prefill, offset: 0, count: count, fed: count)]
    }
    var calls: [FeedCall] = []
    var done = 0
    if let k = extendLength {
        while count - done >= 2, start + done + k <= capacity {
            let n = min(k, count - done)
            calls.append(FeedCall(function: .extend, offset: done, count: n, fed: k))
            done += n
        }
    }
    for i in done..<max(done, count) { calls.append(FeedCall(function: .step, offset: i, count: 1, fed: 1)) }
    return calls
}

public struct TranscriptionResult: Sendable, Codable {
    public var text: String
    public var language: String
    public var punctuation: Bool
    public var windows: [WindowResult]
    /// Digital silence: empty text, no window, no model call (as `cohere-coreml transcribe`).
    public var silent: Bool = false
    /// Length of the audio in seconds.
    public var seconds: Double = 0
    /// Every window's words in order, times on the audio's timeline (nil: not asked; `wordTimestamps: true`).
    public var words: [WordTiming]? = nil
    /// The speech regions the VAD found (samples of the 16 kHz audio); nil when the VAD was off (or the audio
    /// digitally silent: no model call).
    public var speechRegions: [SampleSpan]? = nil
    /// The windows packed from them, the only audio encoded and decoded (nil when the VAD was off).
    public var speechWindows: [SampleSpan]? = nil

    /// With the VAD, Python's `vad` summary: windows, regions, audio and decoded seconds, their ratio (nil: off).
    public var vadSummary: (windows: Int, regions: Int, audioSeconds: Double, decodedSeconds: Double, decodedShare: Double)? {
        guard let speechRegions, let speechWindows else { return nil }
        let decoded = Double(speechWindows.reduce(0) { $0 + $1.count }) / Double(VoiceActivityRule.sampleRate)
        return (speechWindows.count, speechRegions.count, seconds, decoded, seconds > 0 ? decoded / seconds : 0)
    }

    public var truncated: Bool { windows.contains { $0.truncated } }
    public var tokenIds: [[Int]] { windows.map(\.tokenIds) }
}

/// Greedy transcription with an exported bundle: front-end package -> encoder (smallest length bucket
/// that holds the window) -> stateful decoder (a fresh state per window; the cross memory bound into
/// it once per window; the prefill function when the bundle has one), exactly the loop of Python's
/// `Transcriber` (docs/bundle.md). A clip of several windows is decoded `decoderBatch` windows at a time on one
/// state of B rows when the bundle's decoder has a batched step (greedy without word timings; the same tokens).
///
/// An actor: Core ML states must not be shared across threads, so every call runs on the actor. Models
/// load lazily, once: concurrent callers (`prewarm()` beside `transcribe`) await the same load.
/// Long files report each window as it is done (`windows(contentsOf:language:)`), and a cancelled task
/// stops between windows and decoding steps (`CancellationError`).
public actor CohereTranscriber {
    public let bundleURL: URL
    public nonisolated let manifest: BundleManifest
    public let detokenizer: Detokenizer
    public nonisolated let runtime: ModelRuntime
    public let computeUnits: ComponentComputeUnits
    /// The device choice read at init (`deviceChoice:`; DeviceChoice.swift): whether its compute units are used.
    public nonisolated let deviceChoice: DeviceChoice.Applied
    public let usePrefill: Bool
    /// Feed forced prefixes (a prompt prefill does not serve, a streaming partial's confirmed tokens) K tokens
    /// per call when the bundle has an extend function.
    public let useExtend: Bool
    /// Windows a clip of several decodes at once through the decoder's batched step (`decoder.batch`, greedy without
    /// word timings; docs/bundle.md, "Decoding several windows at once"); 1: one window at a time.
    public nonisolated let decoderBatch: Int
    /// Seconds spent loading (and, with Core ML, compiling) the packages so far.
    public private(set) var loadSeconds: Double = 0

    private var loads: [String: Task<LoadedModel, Error>] = [:]
    private let eosIds: Set<Int>

    /// A loaded function and the time its load took.
    struct LoadedModel: Sendable {
        let model: RuntimeModel
        let seconds: Double
    }

    /// Opens `bundle`, loads the decoder functions and the full-window encoder and checks every package
    /// against the manifest. `runtime`: Core ML by default on macOS and iOS; pass an `InterpreterRuntime`
    /// (or, on Linux, a `CoreMLRuntime` over the Core ML emulation) elsewhere.
    /// `computeUnits`: nil takes them from the device choice (`deviceChoice`: by default the one `cohere-transcribe-swift
    /// bench` wrote for this bundle, if any; DeviceChoice.swift), else today's defaults (`ComponentComputeUnits()`).
    /// `decoderBatch`: windows decoded at once when a clip has several (greedy, without word timings): nil the
    /// bundle's batched step (`decoder.batch.size`; 1 when it has none), 1 one window at a time, or exactly the
    /// bundle's size (Python's `Transcriber(decoder_batch=)`).
    public init(bundle: URL, runtime: ModelRuntime? = nil, computeUnits: ComponentComputeUnits? = nil,
                deviceChoice: DeviceChoice.Source = .automatic,
                usePrefill: Bool = true, useExtend: Bool = true, decoderBatch: Int? = nil) async throws {
        let manifest = try BundleManifest.load(bundle: bundle)
        self.decoderBatch = try CohereTranscriber.checkedBatch(decoderBatch, manifest: manifest)
        for (what, file) in [("encoder", manifest.files.encoder), ("decoder", manifest.files.decoder),
                             ("vocabulary", manifest.files.vocab)] {
            guard FileManager.default.fileExists(atPath: bundle.appendingPathComponent(file).path) else {
                throw BundleError.missingFile("the bundle has no \(what) (\(file)) in \(bundle.path)")
            }
        }
        for (_, file) in manifest.files.named where FileManager.default.fileExists(atPath: bundle.appendingPathComponent(file).path) {
            try BundlePath.checkNoSymbolicLinks(file, in: bundle)  // nothing is read through a link
        }
        let runtime = try runtime ?? CohereTranscriber.defaultRuntime()
        let (chosenUnits, applied) = computeUnits == nil ? try DeviceChoice.resolve(deviceChoice, bundle: bundle)
            : (nil, DeviceChoice.Applied.notRead)
        self.deviceChoice = applied
        self.bundleURL = bundle
        self.manifest = manifest
        self.runtime = runtime
        self.computeUnits = computeUnits ?? chosenUnits ?? ComponentComputeUnits()
        self.usePrefill = usePrefill
        self.useExtend = useExtend
        self.detokenizer = try Detokenizer(vocabURL: bundle.appendingPathComponent(manifest.files.vocab))
        self.eosIds = Set(manifest.tokens.eosTokenIds)
        _ = try await decoderModels()
        _ = try await encoder(function: "main")  // the full window: loaded and checked up front
    }

    /// Windows a batched decode takes: the bundle's batched step's rows (`decoder.batch.size`), or 1; another count
    /// is a one-line error naming the export that gives it (Python's `Transcriber._check_batch`). `option`: how the
    /// caller names the setting (the command line: `--decoder-batch`).
    public static func checkedBatch(_ asked: Int?, manifest: BundleManifest, option: String = "decoderBatch") throws -> Int {
        let present = manifest.decoder.hostWritesState ? manifest.decoder.batch?.size ?? 1 : 1
        guard let asked, asked != present else { return present }
        if asked == 1 { return 1 }
        if asked < 1 { throw TranscriptionError.invalidArgument("\(option) must be >= 1, got \(asked)") }
        if present == 1 {
            throw TranscriptionError.invalidArgument("\(option) \(asked): the bundle's decoder has no batched step; re-export "
                + "it with `cohere-coreml export --decoder-batch \(asked)` or use \(option) 1")
        }
        throw TranscriptionError.invalidArgument("\(option) \(asked): the bundle's decoder decodes \(present) windows at once "
            + "(decoder.batch.size); use \(option) \(present) or 1")
    }

    /// A loaded function against the manifest: the arrays the loop uses (from the manifest's sizes), then,
    /// exactly, the I/O the manifest lists for that function (its `io` block, read from the package at export).
    static func check(_ model: RuntimeModel, expected: ModelIO, manifest: BundleManifest, component: String,
                      function: String) throws {
        try checkIO(model.io, expected: expected, exact: false, component: component, function: function)
        if let listed = manifest.listedIO(component: component, function: function) {
            try checkIO(model.io, expected: listed, exact: true, component: component, function: function)
        }
    }

    /// Core ML on macOS and iOS; elsewhere an error pointing at `InterpreterRuntime`.
    static func defaultRuntime() throws -> ModelRuntime {
        #if os(macOS) || os(iOS)
        return try CoreMLRuntime()
        #else
        throw TranscriptionError.invalidArgument(
            "no default runtime on this platform: pass runtime: InterpreterRuntime() (cohere-coreml serve-runtime)"
                + " or, on Linux, CoreMLRuntime() after CoreMLEmulation.use(_:)")
        #endif
    }

    // MARK: - loading

    /// Loads one function of a bundle package once (concurrent callers share the load) and checks it.
    func load(_ key: String, file: String, function: String, units: ComputeUnits,
                      expected: ModelIO, component: String) async throws -> RuntimeModel {
        if let task = loads[key] { return try await task.value.model }
        let url = bundleURL.appendingPathComponent(file)
        let (runtime, manifest) = (self.runtime, self.manifest)
        let task = Task { () throws -> LoadedModel in
            let start = Date()
            let model = try await runtime.loadModel(at: url, functionName: function == "main" ? nil : function,
                                                    computeUnits: units)
            try CohereTranscriber.check(model, expected: expected, manifest: manifest, component: component, function: function)
            return LoadedModel(model: model, seconds: Date().timeIntervalSince(start))
        }
        loads[key] = task
        do {
            let loaded = try await task.value
            loadSeconds += loaded.seconds
            return loaded.model
        } catch {
            loads[key] = nil  // a failed load may be retried
            throw error
        }
    }

    /// Decoder functions: step, bind, prefill (when the bundle has it and `usePrefill`), extend (when the bundle
    /// has it and `useExtend`).
    /// `bind` is nil for a host-state decoder (manifest `decoder.state_writes` "host": the app writes the state).
    private func decoderModels() async throws
        -> (step: RuntimeModel, bind: RuntimeModel?, prefill: RuntimeModel?, extend: RuntimeModel?) {
        let d = manifest.decoder
        let file = manifest.files.decoder
        let stepName = d.functions?.step ?? "main"
        let step = try await load("decoder/\(stepName)", file: file, function: stepName, units: computeUnits.decoder,
                                  expected: manifest.expectedDecoderIO(), component: "decoder")
        var bind: RuntimeModel?
        if d.hostWritesState {
            guard d.memoryStates?.isEmpty == false, d.rowOutputs?.isEmpty == false, d.cacheMaskInput != nil else {
                throw BundleError.unreadableManifest("missing field 'decoder.memory_states', 'decoder.row_outputs' or "
                    + "'decoder.cache_mask_input' (a host-state decoder names what the app writes)")
            }
        } else {
            guard let bindName = d.functions?.bind, d.bindInputs?.isEmpty == false else {
                throw BundleError.unreadableManifest("missing field 'decoder.functions.bind' or 'decoder.bind_inputs' "
                    + "(format 2 bundles bind the cross memory once per window)")
            }
            bind = try await load("decoder/\(bindName)", file: file, function: bindName, units: computeUnits.decoder,
                                  expected: manifest.expectedBindIO(), component: "decoder")
        }
        var prefill: RuntimeModel?
        if usePrefill, let name = d.functions?.prefill, let length = d.prefillLength {
            prefill = try await load("decoder/\(name)", file: file, function: name, units: computeUnits.decoder,
                                     expected: manifest.expectedDecoderIO(prefillLength: length), component: "decoder")
        }
        var extend: RuntimeModel?
        if useExtend, let name = d.functions?.extend, let length = d.extendLength {
            extend = try await load("decoder/\(name)", file: file, function: name, units: computeUnits.decoder,
                                    expected: manifest.expectedExtendIO(extendLength: length), component: "decoder")
        }
        return (step, bind, prefill, extend)
    }

    /// The decoder's batched step (`decoder.functions.step_batch`), loaded once and checked.
    private func batchModel() async throws -> RuntimeModel {
        guard let name = manifest.decoder.functions?.stepBatch, let expected = manifest.expectedBatchDecoderIO() else {
            throw TranscriptionError.invalidArgument("the bundle's decoder has no batched step (decoder.functions.step_batch)")
        }
        return try await load("decoder/\(name)", file: manifest.files.decoder, function: name, units: computeUnits.decoder,
                              expected: expected, component: "decoder")
    }

    /// The decoder's align function (word timings), loaded once and checked.
    private func alignModel(_ alignment: BundleManifest.Alignment) async throws -> RuntimeModel {
        try await load("decoder/\(alignment.function)", file: manifest.files.decoder, function: alignment.function,
                       units: computeUnits.decoder, expected: manifest.expectedAlignIO(alignment), component: "decoder")
    }

    /// The plan of a forced prefix of `count` tokens from slot `start` with the functions this transcriber uses.
    public func plan(count: Int, start: Int = 0, rowsFrom: Int? = nil) -> [FeedCall] {
        let d = manifest.decoder
        return feedPlan(count: count, start: start, capacity: d.capacity,
                        prefillLength: usePrefill && d.functions?.prefill != nil ? d.prefillLength : nil,
                        extendLength: useExtend && d.functions?.extend != nil ? d.extendLength : nil, rowsFrom: rowsFrom)
    }

    /// One encoder function through every part of the encoder (one part: the whole encoder), loaded and checked.
    private func encoder(function: String) async throws -> [RuntimeModel] {
        guard let bucket = manifest.encoderBuckets.first(where: { $0.function == function }) else {
            throw BundleError.ioMismatch(component: "encoder", function: function, detail: "not in the manifest's encoder functions")
        }
        var chain: [RuntimeModel] = []
        for (index, part) in manifest.encoder.parts.enumerated() {
            guard let file = manifest.files.file(forKey: part.file) else {
                throw BundleError.missingFile("the manifest names no file for encoder part \(index + 1) (files.\(part.file))")
            }
            let key = index == 0 ? "encoder/\(function)" : "\(part.file)/\(function)"
            chain.append(try await load(key, file: file, function: function, units: computeUnits.encoder,
                                        expected: manifest.expectedEncoderPartIO(index: index, frames: bucket.frames),
                                        component: part.file))
        }
        return chain
    }

    static let noFrontEnd = BundleError.noFrontEnd(
        "the bundle has no front-end package (manifest files.frontend and frontend): re-export it with `cohere-coreml export` "
            + "(it writes frontend.mlpackage by default), or pass features to transcribeWindow(features:validFrames:prompt:)")

    private func frontEnd(function: String, samples: Int, frames: Int) async throws -> RuntimeModel {
        guard let file = manifest.files.frontend else { throw CohereTranscriber.noFrontEnd }
        guard FileManager.default.fileExists(atPath: bundleURL.appendingPathComponent(file).path) else {
            throw BundleError.missingFile("the bundle has no front end (\(file)) in \(bundleURL.path)")
        }
        return try await load("frontend/\(function)", file: file, function: function, units: computeUnits.frontEnd,
                              expected: manifest.expectedFrontEndIO(samples: samples, frames: frames), component: "frontend")
    }

    /// Loads every encoder, front-end and decoder function now, so the first transcription does not pay
    /// for it (with Core ML the first launch compiles: minutes for the 2 B encoder on the Neural Engine).
    public func prewarm() async throws {
        _ = try await decoderModels()
        if decoderBatch > 1 { _ = try await batchModel() }
        for bucket in manifest.encoderBuckets {
            _ = try await encoder(function: bucket.function)
        }
        for (function, f) in (manifest.frontend?.functions ?? [:]).sorted(by: { $0.key < $1.key })
        where manifest.files.frontend != nil {
            _ = try await frontEnd(function: function, samples: f.samples, frames: f.frames)
        }
        if let alignment = try? manifest.checkedAlignment(promptLength: manifest.decoder.promptLength) {
            _ = try await alignModel(alignment)  // word timings
        }
        if manifest.vad != nil, manifest.files.vad != nil {  // the VAD's functions (whole signals, streams)
            _ = try await vadModel(VoiceActivity.blockFunction)
            _ = try await vadModel(VoiceActivity.chunkFunction)
        }
    }

    /// Releases every loaded model (memory back to the system); the next call loads them again (from
    /// the compiled-model cache with Core ML).
    public func unload() {
        loads.removeAll()
    }

    /// Functions loaded so far ("component/function").
    public var loadedFunctions: [String] { loads.keys.sorted() }

    // MARK: - whole clips

    /// `wordTimestamps`: each word's start, end and probability (`TranscriptionResult.words`; the bundle's
    /// `decoder.alignment`: one align call per window after its decoding, docs/word-timings.md).
    /// `vad`: speech regions from the bundle's `vad.mlpackage` (`.auto`: when the bundle has it), windows packed
    /// from them by the rule of docs/vad.md (`vadOptions`), only those windows encoded and decoded; every time
    /// stays on the audio's timeline.
    public func transcribe(contentsOf url: URL, language: String, punctuation: Bool = true,
                           maxNewTokens: Int? = nil, wordTimestamps: Bool = false, vad: VADMode = .auto,
                           vadOptions: VADOptions = VADOptions()) async throws -> TranscriptionResult {
        try await transcribe(contentsOf: url, language: language, punctuation: punctuation, maxNewTokens: maxNewTokens,
                             wordTimestamps: wordTimestamps, vad: vad, vadOptions: vadOptions, onWindow: nil)
    }

    /// Transcribes mono Float samples at the bundle's sample rate (16 kHz).
    public func transcribe(samples: [Float], language: String, punctuation: Bool = true,
                           maxNewTokens: Int? = nil, wordTimestamps: Bool = false, vad: VADMode = .auto,
                           vadOptions: VADOptions = VADOptions()) async throws -> TranscriptionResult {
        let prompt = try manifest.prompt(language: language, punctuation: punctuation)
        if wordTimestamps { _ = try manifest.checkedAlignment(promptLength: prompt.count) }  // before any work
        let useVAD = try checkedVAD(vad, options: vadOptions)
        return try await transcribe(samples: samples, language: language, punctuation: punctuation,
                                    maxNewTokens: maxNewTokens, wordTimestamps: wordTimestamps, useVAD: useVAD,
                                    vadOptions: vadOptions, name: "audio", prompt: prompt, onWindow: nil)
    }

    /// Whether `mode` runs the VAD, with `options` checked: before any work (`.on` without the package: an error).
    nonisolated func checkedVAD(_ mode: VADMode, options: VADOptions) throws -> Bool {
        let on = try usesVAD(mode)
        if on { try options.validate() }
        return on
    }

    /// The windows of a file as each is transcribed (long files: one result every 35 s of audio).
    /// Cancelling the consuming task stops the transcription between windows or decoding steps.
    public nonisolated func windows(contentsOf url: URL, language: String, punctuation: Bool = true,
                                    maxNewTokens: Int? = nil, wordTimestamps: Bool = false, vad: VADMode = .auto,
                                    vadOptions: VADOptions = VADOptions()) -> AsyncThrowingStream<WindowResult, Error> {
        AsyncThrowingStream { continuation in
            let task = Task {
                do {
                    _ = try await self.transcribe(contentsOf: url, language: language, punctuation: punctuation,
                                                  maxNewTokens: maxNewTokens, wordTimestamps: wordTimestamps, vad: vad,
                                                  vadOptions: vadOptions) { continuation.yield($0) }
                    continuation.finish()
                } catch {
                    continuation.finish(throwing: error)
                }
            }
            continuation.onTermination = { _ in task.cancel() }
        }
    }

    /// `onWindow` is called with each window as soon as it is decoded.
    public func transcribe(contentsOf url: URL, language: String, punctuation: Bool = true, maxNewTokens: Int? = nil,
                           wordTimestamps: Bool = false, vad: VADMode = .auto, vadOptions: VADOptions = VADOptions(),
                           onWindow: (@Sendable (WindowResult) -> Void)?) async throws -> TranscriptionResult {
        let prompt = try manifest.prompt(language: language, punctuation: punctuation)  // unknown language: before any work
        if wordTimestamps { _ = try manifest.checkedAlignment(promptLength: prompt.count) }  // no alignment: likewise
        let useVAD = try checkedVAD(vad, options: vadOptions)  // --vad on without the package: likewise
        let audio = try AudioInput.load(contentsOf: url, sampleRate: manifest.audio.samplingRate)
        return try await transcribe(samples: audio.samples, language: language, punctuation: punctuation,
                                    maxNewTokens: maxNewTokens, wordTimestamps: wordTimestamps, useVAD: useVAD,
                                    vadOptions: vadOptions, name: url.path, prompt: prompt, onWindow: onWindow)
    }

    private func transcribe(samples: [Float], language: String, punctuation: Bool, maxNewTokens: Int?,
                            wordTimestamps: Bool, useVAD: Bool, vadOptions: VADOptions, name: String, prompt: [Int],
                            onWindow: (@Sendable (WindowResult) -> Void)?) async throws -> TranscriptionResult {
        if try AudioInput.isSilent(samples, name: name) {
            return TranscriptionResult(text: "", language: language, punctuation: punctuation, windows: [], silent: true,
                                       seconds: Double(samples.count) / Double(manifest.audio.samplingRate),
                                       words: wordTimestamps ? [] : nil)
        }
        let rate = Double(manifest.audio.samplingRate)
        // the VAD: only the windows packed from speech regions (none: an empty transcript); else the whole audio
        var found: (regions: [SampleSpan], windows: [SampleSpan])?
        let ranges: [Range<Int>]
        if useVAD {
            found = try await speechWindows(samples, options: vadOptions)
            ranges = found!.windows.map { $0.start..<$0.end }
        } else {
            ranges = AudioSplitter.splitPoints(samples, manifest: manifest)
        }
        var windows: [WindowResult] = []
        if decoderBatch > 1, !wordTimestamps, ranges.count > 1 {  // greedy without word timings: several windows at once
            windows = try await transcribeBatched(samples, ranges: ranges, prompt: prompt, maxNewTokens: maxNewTokens,
                                                  onWindow: onWindow)
        } else {
            for (i, range) in ranges.enumerated() {
                try Task.checkCancellation()
                let piece = Array(samples[range])
                let start = Date()
                let (features, valid) = try await features(of: piece)
                let featuresSeconds = Date().timeIntervalSince(start)
                var window = try await transcribeWindow(features: features, validFrames: valid, prompt: prompt,
                                                        maxNewTokens: maxNewTokens, index: i,
                                                        startSeconds: Double(range.lowerBound) / rate,
                                                        durationSeconds: Double(piece.count) / rate,
                                                        language: language, wordTimestamps: wordTimestamps)
                window.durationSeconds = Double(piece.count) / rate
                window.timings.featuresSeconds = featuresSeconds
                windows.append(window)
                onWindow?(window)
            }
        }
        let text = Detokenizer.joinWindows(windows.map(\.text), language: language,
                                           noSpaceLanguages: manifest.generation.noSpaceLanguages)
        return TranscriptionResult(text: text, language: language, punctuation: punctuation, windows: windows,
                                   seconds: Double(samples.count) / rate,
                                   words: wordTimestamps ? windows.flatMap { $0.words ?? [] } : nil,
                                   speechRegions: found?.regions, speechWindows: found?.windows)
    }

    /// Log-mel features of one piece through the front-end package: ((1, n_mels, frames) float32, valid frames),
    /// `frames` those of the smallest encoder bucket that holds the piece. As Python's
    /// `Transcriber.package_features`: the front-end function is the smallest whose window holds the samples
    /// and those frames; its features are cut to the encoder's frames (frames past the valid ones are zero).
    public func features(of piece: [Float]) async throws -> (Tensor, Int) {
        let a = manifest.audio
        let valid = (piece.count + 2 * (a.nFFT / 2) - a.nFFT) / a.hopLength
        guard valid >= 2 else {
            throw AudioError.invalid("audio is too short: \(piece.count) samples give \(max(valid, 0)) feature frame(s); at least \(2 * a.hopLength) samples are needed")
        }
        guard let bucket = manifest.encoderBuckets.first(where: { valid <= $0.frames }) else {
            throw AudioError.invalid("a piece of \(valid) feature frames does not fit the encoder window (\(a.windowFrames)): split it with AudioSplitter")
        }
        guard manifest.files.frontend != nil, manifest.frontend != nil else { throw CohereTranscriber.noFrontEnd }
        guard let fn = manifest.frontEndFunction(samples: piece.count, frames: bucket.frames) else {
            throw AudioError.invalid("a piece of \(piece.count) samples does not fit the front end's longest window: split it with AudioSplitter")
        }
        let model = try await frontEnd(function: fn.function, samples: fn.samples, frames: fn.frames)
        var padded = piece
        padded.append(contentsOf: [Float](repeating: 0, count: fn.samples - piece.count))
        let out = try await model.predict(["audio": try Tensor(float32: padded, shape: [1, fn.samples]),
                                           "audio_length": try Tensor(int32: [Int32(piece.count)], shape: [1])], state: nil)
        guard let features = out["input_features"], let length = out["feature_length"], length.dtype == .int32,
              features.dtype == .float32, features.shape.count == 3, features.shape[2] >= bucket.frames else {
            throw TranscriptionError.badOutput("the front-end package returned no float32 (1, M, >= \(bucket.frames)) input_features / int32 feature_length")
        }
        let frontValid = Int(length.int32s()[0])
        guard frontValid == valid else {
            throw TranscriptionError.badOutput("front end says \(frontValid) valid frames, the audio has \(valid)")
        }
        return (try features.croppingLastAxis(to: bucket.frames), valid)
    }

    // MARK: - one window

    /// Greedy decode of one window from its log-mel features ((1, n_mels, F) or (n_mels, F) float32, F the
    /// frames of an encoder function) and valid frame count. `prompt`: the language prompt ids.
    /// `draft`: see `decode(cross:prompt:maxNewTokens:draft:)` (the streaming partials' previous hypothesis).
    /// `wordTimestamps`: the window's words (`WindowResult.words`) on the audio's timeline (`startSeconds` on),
    /// each clamped to the window [startSeconds, startSeconds + durationSeconds] (`durationSeconds`: by default
    /// the valid frames' length); `language` ja or zh: a word per character.
    public func transcribeWindow(features: Tensor, validFrames: Int, prompt: [Int], maxNewTokens: Int? = nil,
                                 index: Int = 0, startSeconds: Double = 0, durationSeconds: Double? = nil,
                                 draft: [Int] = [], language: String? = nil,
                                 wordTimestamps: Bool = false) async throws -> WindowResult {
        let frames = features.shape.last ?? 0
        guard let bucket = manifest.encoderBuckets.first(where: { $0.frames == frames }) else {
            throw TranscriptionError.invalidArgument(
                "features have \(frames) frames; the encoder takes \(manifest.encoderBuckets.map { String($0.frames) }.joined(separator: " or "))")
        }
        let (cross, encoderSeconds) = try await encode(features: features, validFrames: validFrames, function: bucket.function)
        let alignment = wordTimestamps ? try manifest.checkedAlignment(promptLength: prompt.count) : nil
        let decoded = try await decode(cross: cross, prompt: prompt, maxNewTokens: maxNewTokens, draft: draft,
                                       alignment: alignment)
        let text = try detokenizer.decode(decoded.tokens.filter { !eosIds.contains($0) })
        let duration = durationSeconds ?? Double(validFrames * manifest.audio.hopLength) / Double(manifest.audio.samplingRate)
        var words: [WordTiming]?
        var alignSeconds = 0.0
        if let alignment {
            let ta = Date()
            words = try windowWords(decoded, alignment: alignment, prompt: prompt,
                                    frames: manifest.encoder.lengthMasks.encoderLength(validFrames: validFrames),
                                    start: startSeconds, end: startSeconds + duration, language: language)
            alignSeconds = decoded.alignSeconds + Date().timeIntervalSince(ta)
        }
        let calls = max(decoded.calls, 1)
        let timings = WindowTimings(featuresSeconds: 0, encoderSeconds: encoderSeconds, encoderFunction: bucket.function,
                                    bindSeconds: decoded.bindSeconds, promptSeconds: decoded.promptSeconds,
                                    decodeSeconds: decoded.decodeSeconds, decoderCalls: decoded.calls,
                                    msPerDecoderCall: 1000 * (decoded.promptSeconds + decoded.decodeSeconds) / Double(calls),
                                    decoderTokensFed: decoded.tokensFed, decoderStateBytesWritten: decoded.stateBytesWritten,
                                    alignSeconds: alignSeconds)
        return WindowResult(index: index, startSeconds: startSeconds, durationSeconds: duration,
                            tokenIds: decoded.tokens, text: text, truncated: decoded.stopReason != .eos,
                            stopReason: decoded.stopReason, timings: timings, words: words)
    }

    /// The cross memory (cross_k, cross_v, cross_mask) of one window's features through the encoder function
    /// `function` (every part of an encoder in parts), and the seconds it took.
    func encode(features: Tensor, validFrames: Int, function: String) async throws -> (cross: [String: Tensor], seconds: Double) {
        let frames = features.shape.last ?? 0
        let input = try Tensor(dtype: .float32, shape: [1, manifest.encoder.numMelBins, frames], data: features.data)
        let parts = try await encoder(function: function)
        // the encoder computes no lengths: the host's float16 length masks (manifest encoder.length_masks)
        var inputs = try manifest.encoder.lengthMasks.tensors(validFrames: validFrames, frames: frames)
        inputs["input_features"] = input
        let t0 = Date()
        var encoded = try await parts[0].predict(inputs, state: nil)
        for part in parts.dropFirst() {  // an encoder in parts: each next one on the previous hidden state
            guard let hidden = encoded["hidden_states_out"], let mask = inputs["encoder_mask"] else {
                throw TranscriptionError.badOutput("an encoder part returned no hidden_states_out")
            }
            encoded = try await part.predict(["hidden_states": hidden, "encoder_mask": mask], state: nil)
        }
        let seconds = Date().timeIntervalSince(t0)
        var cross: [String: Tensor] = [:]
        for name in ["cross_k", "cross_v", "cross_mask"] {
            guard let t = encoded[name] else { throw TranscriptionError.badOutput("the encoder package returned no \(name)") }
            cross[name] = t
        }
        return (cross, seconds)
    }

    /// One window's features and cross memory, and the seconds each took (a batched clip's encoder stage).
    struct EncodedWindow: Sendable {
        var index: Int
        var range: Range<Int>
        var cross: [String: Tensor]
        var featuresSeconds: Double
        var encoderSeconds: Double
        var function: String
    }

    private func encodeWindow(_ samples: [Float], index: Int, range: Range<Int>) async throws -> EncodedWindow {
        try Task.checkCancellation()
        let t0 = Date()
        let (features, valid) = try await features(of: Array(samples[range]))
        let featuresSeconds = Date().timeIntervalSince(t0)
        guard let function = manifest.encoderBuckets.first(where: { $0.frames == features.shape.last })?.function else {
            throw TranscriptionError.badOutput("features of \(features.shape) fit no encoder function")
        }
        let (cross, encoderSeconds) = try await encode(features: features, validFrames: valid, function: function)
        return EncodedWindow(index: index, range: range, cross: cross, featuresSeconds: featuresSeconds,
                             encoderSeconds: encoderSeconds, function: function)
    }

    /// A clip's windows decoded `decoderBatch` at a time through the decoder's batched step (`BatchDecoding.decodeWindows`,
    /// Python's `batch_decoding.transcribe_batched`), in two stages: the next window's front end and encoder run (a
    /// task of this actor, no state) while the rows decode, and the window enters the first row that frees up, so at
    /// most B + 1 memories are held. The decoder's one state of B rows is made and used only by this call's task, on
    /// this actor. Returns the windows in clip order (`onWindow` gets each once every earlier one is done), each as the
    /// batch-1 loop gives it (its tokens, text, stop reason; its timings: its features and encoder, its share of the
    /// batched calls).
    private func transcribeBatched(_ samples: [Float], ranges: [Range<Int>], prompt: [Int], maxNewTokens: Int?,
                                   onWindow: (@Sendable (WindowResult) -> Void)?) async throws -> [WindowResult] {
        let decoder = try RuntimeBatchDecoder(model: try await batchModel(), manifest: manifest)
        let rate = Double(manifest.audio.samplingRate)
        var waiting = ranges.enumerated().makeIterator()
        var entered: [Int: EncodedWindow] = [:]
        var done: [Int: WindowResult] = [:]
        var windows: [WindowResult] = []
        /// The encoder stage: the next waiting window's features and memory, computed while the rows decode.
        func encodeNext() -> Task<EncodedWindow, Error>? {
            guard let (i, range) = waiting.next() else { return nil }
            return Task { try await self.encodeWindow(samples, index: i, range: range) }
        }
        var ahead = encodeNext()
        defer { ahead?.cancel() }  // a failed or cancelled decode leaves no encoder work behind
        try await BatchDecoding.decodeWindows(decoder, prompt: prompt, eosIds: eosIds, maxNewTokens: maxNewTokens, next: {
            guard let task = ahead else { return nil }
            let w = try await withTaskCancellationHandler { try await task.value } onCancel: { task.cancel() }
            ahead = encodeNext()  // the following window's encoder starts as this one enters its row
            var held = w
            held.cross = [:]  // its memory goes into the row; only its timings stay here
            entered[w.index] = held
            return (w.index, w.cross)
        }, finished: { i, decoded in
            guard let w = entered.removeValue(forKey: i) else { return }
            let calls = max(decoded.calls, 1)
            let timings = WindowTimings(
                featuresSeconds: w.featuresSeconds, encoderSeconds: w.encoderSeconds, encoderFunction: w.function,
                bindSeconds: decoded.bindSeconds, promptSeconds: decoded.promptSeconds, decodeSeconds: decoded.decodeSeconds,
                decoderCalls: decoded.calls, msPerDecoderCall: 1000 * (decoded.promptSeconds + decoded.decodeSeconds) / Double(calls),
                decoderTokensFed: decoded.calls, decoderStateBytesWritten: decoded.bindBytes + decoded.calls * decoder.rowBytes,
                decoderBatch: decoder.batch)
            done[i] = WindowResult(
                index: i, startSeconds: Double(w.range.lowerBound) / rate, durationSeconds: Double(w.range.count) / rate,
                tokenIds: decoded.tokens, text: try self.detokenizer.decode(decoded.tokens.filter { !self.eosIds.contains($0) }),
                truncated: decoded.stopReason != .eos, stopReason: decoded.stopReason, timings: timings)
            while let next = done.removeValue(forKey: windows.count) {  // in clip order
                if !windows.isEmpty { try Task.checkCancellation() }  // cancelled: stops between windows
                windows.append(next)
                onWindow?(next)
            }
        })
        return windows
    }

    /// The alignment heads' weights of a window's tokens: `positions` rows (row p the query at slot p, predicting
    /// token p + 1) of `frames` encoder frames per head, flat; rows before the first the rule reads not computed.
    struct AlignWeights {
        var values: [Float]
        var heads: Int
        var positions: Int
        var frames: Int
    }

    /// The first slots of the align calls covering rows rowsFrom..<count, `length` (K) rows a call; a call that
    /// would pass the cache starts at capacity - K instead (Python's `decoder_runtime.align_starts`).
    static func alignStarts(count: Int, rowsFrom: Int, length: Int, capacity: Int) -> [Int] {
        var starts: [Int] = [], start = rowsFrom
        while start < count {
            start = min(start, capacity - length)
            starts.append(start)
            start += length
        }
        return starts
    }

    /// The align function over a window's `ids` (prompt + text tokens, no eos) after its decoding, on the same
    /// state: its self cache holds their K/V (the last token may be missing: a call computes its own tokens'),
    /// its cross memory is the window's. K rows a call, each the host-state extend's inputs: `input_ids` (the
    /// tokens of slots start..., then padding: 0, never seen by the real ones), `position` (start) and the mask
    /// of the slots before it (Python's `DecoderRuntime.align`).
    func align(_ ids: [Int], rowsFrom: Int, alignment: BundleManifest.Alignment, model: RuntimeModel,
               state: RuntimeState) async throws -> AlignWeights {
        let (capacity, k, heads) = (manifest.decoder.capacity, alignment.length, alignment.heads.count)
        guard (1...capacity).contains(ids.count), (0..<ids.count).contains(rowsFrom), k <= capacity else {
            throw TranscriptionError.invalidArgument("word timings: \(ids.count) tokens from row \(rowsFrom) do not fit the "
                + "align function (\(k) tokens a call, \(capacity) cache slots)")
        }
        var out: AlignWeights?
        for start in Self.alignStarts(count: ids.count, rowsFrom: rowsFrom, length: k, capacity: capacity) {
            try Task.checkCancellation()
            let part = ids[start..<min(start + k, ids.count)].map(Int32.init)
            let inputs = ["input_ids": try Tensor(int32: part + [Int32](repeating: 0, count: k - part.count), shape: [1, k]),
                          "position": try Tensor(int32: [Int32(start)], shape: [1]),
                          "cache_mask": try Tensor.cacheMask(filled: start, capacity: capacity)]
            guard let weights = try await model.predict(inputs, state: state)[BundleManifest.alignOutput],
                  weights.shape.count == 4, weights.shape[0] == 1, weights.shape[1] == heads, weights.shape[2] == k else {
                throw TranscriptionError.badOutput("the decoder's \(alignment.function) function returned no (1, \(heads), \(k), "
                    + "frames) \(BundleManifest.alignOutput)")
            }
            let frames = weights.shape[3]
            var o = out ?? AlignWeights(values: [Float](repeating: .nan, count: heads * ids.count * frames), heads: heads,
                                        positions: ids.count, frames: frames)
            let values = weights.floats()
            for h in 0..<heads {
                for row in max(start, rowsFrom)..<min(start + k, ids.count) {
                    let from = (h * k + row - start) * frames, to = (h * ids.count + row) * frames
                    o.values.replaceSubrange(to..<to + frames, with: values[from..<from + frames])
                }
            }
            out = o
        }
        return out!
    }

    /// One window's words from its decode's align output: the rows predicting the prompt's last `leadRows`
    /// tokens, each text token and eos (`WordAlignment.rows`), over the window's `frames` valid encoder frames;
    /// the rule with each token's probability from decoding; times from `start`, clamped to [start, end].
    /// A window that filled the cache times the tokens the cache holds (its last one has no slot).
    func windowWords(_ decoded: Decoded, alignment: BundleManifest.Alignment, prompt: [Int], frames: Int,
                     start: Double, end: Double, language: String?) throws -> [WordTiming] {
        let text = decoded.tokens.filter { !eosIds.contains($0) }
        let count = min(text.count, manifest.decoder.capacity - prompt.count)
        guard count > 0 else { return [] }
        guard let attention = decoded.attention, attention.positions == prompt.count + count, attention.frames >= frames else {
            throw TranscriptionError.badOutput("the decoder's \(alignment.function) function returned no weights over "
                + "\(frames) encoder frames for \(prompt.count + count) tokens")
        }
        let rows = try WordAlignment.rows(attention.values, heads: attention.heads, positions: attention.positions,
                                          totalFrames: attention.frames, promptLength: prompt.count, tokens: count,
                                          leadRows: alignment.leadRows, frames: frames)
        let pieces = try text.prefix(count).map { id -> String in
            guard detokenizer.pieces.indices.contains(id) else {
                throw TranscriptionError.badOutput("token id \(id) is outside the vocabulary (\(detokenizer.pieces.count) pieces)")
            }
            return detokenizer.pieces[id]
        }
        let probabilities = decoded.tokenLogProbs.prefix(count).map { Foundation.exp($0) }
        return try WordAlignment.words(attention: rows, pieces: pieces, probabilities: Array(probabilities),
                                       frameSeconds: alignment.frameSeconds, offsetSeconds: start,
                                       leadRows: alignment.leadRows, language: language).map {
            WordTiming(text: $0.text, start: min(max($0.start, start), end), end: min(max($0.end, start), end),
                       probability: $0.probability)
        }
    }

    struct Decoded {
        var tokens: [Int]
        var stopReason: StopReason
        var calls: Int
        var tokensFed: Int
        var bindSeconds: Double
        var promptSeconds: Double
        var decodeSeconds: Double
        var stateBytesWritten = 0
        /// The log-probability of each emitted token at the call that chose it.
        var tokenLogProbs: [Double] = []
        /// The align function's weights for the window's prompt + text tokens when word timings were asked.
        var attention: AlignWeights?
        var alignSeconds = 0.0
    }

    /// The decoding loop of docs/bundle.md: fresh state, the cross memory bound into it once by the bind
    /// function (a host-state decoder: written into it by this loop, which also writes each call's new K/V
    /// rows and passes the mask of the filled cache slots), prompt (by `plan`: prefill, extend calls or steps), greedy to eos, the cache capacity or `maxNewTokens`. A
    /// step binds only its token and position.
    /// `draft`: tokens the decode is expected to emit (a streaming partial's previous hypothesis after its
    /// confirmed tokens), verified with the bundle's extend function exactly as Python's `Transcriber.decode`
    /// verifies it (the tokens are greedy's; without extend it is not used).
    /// `alignment`: after decoding, the align function on the window's final tokens, same state (its cross memory).
    func decode(cross: [String: Tensor], prompt: [Int], maxNewTokens: Int?, draft: [Int] = [],
                alignment: BundleManifest.Alignment? = nil) async throws -> Decoded {
        let capacity = manifest.decoder.capacity
        guard prompt.count < capacity else {
            throw TranscriptionError.invalidArgument("prompt of \(prompt.count) tokens does not fit the cache (\(capacity) slots)")
        }
        var limit = capacity - prompt.count + 1  // the last prediction is emitted without being fed
        var reasonAtLimit = StopReason.capacity
        if let maxNewTokens {
            guard maxNewTokens >= 1 else { throw TranscriptionError.invalidArgument("maxNewTokens must be >= 1, got \(maxNewTokens)") }
            if maxNewTokens < limit { (limit, reasonAtLimit) = (maxNewTokens, .maxNewTokens) }
        }
        let (decoder, binder, prefill, extend) = try await decoderModels()
        let output = manifest.decoder.output
        let state = try decoder.makeState()
        let tb = Date()
        let host = manifest.decoder.hostWritesState
        var stateBytesWritten = 0  // by this loop (host-state decoder): the memory once, then the calls' rows
        if let binder {
            var bindInputs: [String: Tensor] = [:]  // the window's cross memory, bound into the state once
            for (input, output) in manifest.decoder.bindInputs ?? [:] {
                guard let t = cross[output] else {
                    throw BundleError.ioMismatch(component: "decoder", function: binder.functionName,
                                                 detail: "bind input '\(input)' takes '\(output)', which the encoder does not return")
                }
                bindInputs[input] = t
            }
            _ = try await binder.predict(bindInputs, state: state)
        } else {  // host-state decoder: the window's cross memory written into the (fresh) state, once, as fp16
            for (name, output) in (manifest.decoder.memoryStates ?? [:]).sorted(by: { $0.key < $1.key }) {
                guard let t = cross[output] else {
                    throw BundleError.ioMismatch(component: "decoder", function: decoder.functionName,
                                                 detail: "state '\(name)' takes '\(output)', which the encoder does not return")
                }
                let half = try t.asFloat16()
                stateBytesWritten += try state.write(name, half, at: [Int](repeating: 0, count: half.shape.count))
            }
        }
        let bindSeconds = Date().timeIntervalSince(tb)
        let capacityMask = manifest.decoder.cacheMaskInput ?? "cache_mask"
        /// One decoder call whose first token goes to cache slot `start`: a host-state decoder also takes the
        /// mask of the filled slots (0 for slots < start, -1e4 else) and returns the call's new K/V rows, which
        /// are written into the state at slots start.. (one K/V row per layer and token). Its outputs.
        func run(_ model: RuntimeModel, _ inputs: [String: Tensor], start: Int) async throws -> [String: Tensor] {
            var inputs = inputs
            if host, model.io.inputs[capacityMask] != nil { inputs[capacityMask] = try Tensor.cacheMask(filled: start, capacity: capacity) }
            let out = try await model.predict(inputs, state: state)
            if host {
                for (name, rowsName) in (manifest.decoder.rowOutputs ?? [:]).sorted(by: { $0.key < $1.key }) {
                    guard let rows = out[rowsName], rows.shape.count == 4 else {
                        throw TranscriptionError.badOutput("the decoder function '\(model.functionName)' returned no \(rowsName) rows")
                    }
                    stateBytesWritten += try state.write(name, try rows.asFloat16(), at: [0, 0, start, 0])
                }
            }
            return out
        }
        func logProbs(_ out: [String: Tensor]) throws -> [Float] {
            guard let t = out[output] else { throw TranscriptionError.badOutput("the decoder package returned no \(output)") }
            return t.floats()
        }
        func step(_ token: Int, _ position: Int) async throws -> [Float] {
            try Task.checkCancellation()
            let inputs = ["input_ids": try Tensor(int32: [Int32(token)], shape: [1, 1]),
                          "position": try Tensor(int32: [Int32(position)], shape: [1])]
            return try logProbs(try await run(decoder, inputs, start: position))
        }
        let vocab = manifest.decoder.vocabSize
        var calls = 0
        var tokensFed = 0
        /// Feeds `ids` at slots start.. by `plan`; the log-probs after each token (nil where a prefill call
        /// gives only its last row). Python's `DecoderRuntime.feed`.
        func feed(_ ids: [Int], start: Int, rowsFrom: Int? = nil) async throws -> [[Float]?] {
            var after: [[Float]?] = []
            for call in plan(count: ids.count, start: start, rowsFrom: rowsFrom) {
                let part = Array(ids[call.offset..<call.offset + call.count])
                switch call.function {
                case .prefill:
                    guard let prefill else { throw TranscriptionError.invalidArgument("internal: a prefill call without prefill") }
                    let inputs = ["input_ids": try Tensor(int32: part.map(Int32.init), shape: [1, part.count])]
                    after += [[Float]?](repeating: nil, count: part.count - 1)
                    after.append(try logProbs(try await run(prefill, inputs, start: 0)))
                case .extend:
                    guard let extend else { throw TranscriptionError.invalidArgument("internal: an extend call without extend") }
                    try Task.checkCancellation()
                    // K ids: the real ones, then EXTEND_PAD_ID (0); never read, overwritten before any later token sees them
                    var padded = part.map(Int32.init)
                    padded.append(contentsOf: [Int32](repeating: 0, count: call.fed - part.count))
                    let inputs = ["input_ids": try Tensor(int32: padded, shape: [1, call.fed]),
                                  "position": try Tensor(int32: [Int32(start + call.offset)], shape: [1])]
                    let rows = try logProbs(try await run(extend, inputs, start: start + call.offset))  // (1, K, V)
                    guard rows.count == call.fed * vocab else {
                        throw TranscriptionError.badOutput("the extend function returned \(rows.count) log-probs, not \(call.fed) x \(vocab)")
                    }
                    for i in 0..<part.count { after.append(Array(rows[(i * vocab)..<((i + 1) * vocab)])) }
                case .step:
                    after.append(try await step(part[0], start + call.offset))
                }
                calls += 1
                tokensFed += call.fed
            }
            return after
        }
        let t0 = Date()
        // the draft (Python's `Transcriber.decode(draft=)`): fed with the prompt, verified, never forced
        let extendLength = useExtend && manifest.decoder.functions?.extend != nil ? manifest.decoder.extendLength : nil
        var draft = extendLength == nil ? [] : Array(draft.prefix(max(0, limit - 1)))
        var pending = Array(try await feed(prompt + draft, start: 0, rowsFrom: prompt.count - 1).suffix(draft.count + 1))
        guard var scores = pending[0] else { throw TranscriptionError.badOutput("internal: no log-probs after the prompt") }
        let t1 = Date()
        var tokens: [Int] = []
        var tokenLogProbs: [Double] = []
        var position = prompt.count
        var redrafted = false  // the current draft was fed after a refused token and none of it is verified yet
        var stopReason = reasonAtLimit
        while true {
            var best = 0
            for (i, v) in scores.enumerated() {
                guard v.isFinite else {
                    throw TranscriptionError.badOutput("decoder produced non-finite log-probs at position \(position - 1)")
                }
                if v > scores[best] { best = i }  // first index on ties, as numpy's argmax
            }
            tokens.append(best)
            tokenLogProbs.append(Double(scores[best]))
            if eosIds.contains(best) { stopReason = .eos; break }
            if tokens.count >= limit { break }
            if let first = draft.first, first == best {  // drafted: already fed at `position`
                draft.removeFirst()
                pending.removeFirst()
                redrafted = false
                guard let next = pending[0] else { throw TranscriptionError.badOutput("internal: no log-probs after a draft token") }
                scores = next
                position += 1
                continue
            }
            // the draft after the replaced token, unless a re-draft was refused at once (then it is off track)
            var rest: [Int] = []
            if let k = extendLength, !draft.isEmpty, !redrafted {
                rest = Array(draft.dropFirst().prefix(min(k - 1, limit - tokens.count - 1)))
            }
            if let k = extendLength, !rest.isEmpty, position + k <= capacity {
                pending = try await feed([best] + rest, start: position)  // one extend call
                (draft, redrafted) = (rest, true)
                guard let next = pending[0] else { throw TranscriptionError.badOutput("internal: no log-probs after a token") }
                scores = next
                position += 1
                continue
            }
            draft = []
            scores = try await step(best, position)
            position += 1
            calls += 1
            tokensFed += 1
        }
        let decodeSeconds = Date().timeIntervalSince(t1)
        var attention: AlignWeights?
        let ta = Date()
        if let alignment, tokens.contains(where: { !eosIds.contains($0) }) {
            // the window's prompt + text tokens (eos not included; those the cache holds), on the decoded state
            let text = tokens.filter { !eosIds.contains($0) }.prefix(capacity - prompt.count)
            attention = try await align(prompt + text, rowsFrom: prompt.count - 1 - alignment.leadRows, alignment: alignment,
                                        model: try await alignModel(alignment), state: state)
        }
        return Decoded(tokens: tokens, stopReason: stopReason, calls: calls, tokensFed: tokensFed, bindSeconds: bindSeconds,
                       promptSeconds: t1.timeIntervalSince(t0), decodeSeconds: decodeSeconds,
                       stateBytesWritten: stateBytesWritten, tokenLogProbs: tokenLogProbs, attention: attention,
                       alignSeconds: alignment == nil ? 0 : Date().timeIntervalSince(ta))
    }
}
