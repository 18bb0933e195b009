import Foundation

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
    /// "eos" | "max_new_tokens" | "capacity".
    public var stopReason: String
    public var timings: WindowTimings
}

/// Warm-call timings of one window, in seconds (model loading and compiling are in `loadSeconds`).
public struct WindowTimings: Sendable, Codable {
    public var featuresSeconds: Double
    public var encoderSeconds: Double
    public var encoderFunction: String
    public var promptSeconds: Double
    public var decodeSeconds: Double
    public var decoderCalls: Int
    public var msPerDecoderCall: Double
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

    public var truncated: Bool { windows.contains { $0.truncated } }
    public var tokenIds: [[Int]] { windows.map(\.tokenIds) }
}

/// Greedy transcription with an exported bundle: front-end package -> encoder (smallest length bucket
/// that holds the window) -> stateful decoder (a fresh state per window, the prefill function when the
/// bundle has one), exactly the loop of Python's `Transcriber` (docs/bundle.md).
///
/// An actor: Core ML states must not be shared across threads, so every call runs on the actor.
public actor CohereTranscriber {
    public let bundleURL: URL
    public nonisolated let manifest: BundleManifest
    public let detokenizer: Detokenizer
    public let runtime: ModelRuntime
    public let computeUnits: ComponentComputeUnits
    /// Seconds spent loading (and, with Core ML, compiling) the packages so far.
    public private(set) var loadSeconds: Double = 0

    private var encoders: [String: RuntimeModel] = [:]
    private var frontEnds: [String: RuntimeModel] = [:]
    private let decoder: RuntimeModel
    private let prefill: RuntimeModel?
    private let eosIds: Set<Int>

    /// Opens `bundle`, loads the decoder (and prefill) and the full-window encoder and checks every
    /// package against the manifest. `runtime`: Core ML by default on Apple platforms; pass an
    /// `InterpreterRuntime` elsewhere.
    public init(bundle: URL, runtime: ModelRuntime? = nil, computeUnits: ComponentComputeUnits = .init(),
                usePrefill: Bool = true) async throws {
        let manifest = try BundleManifest.load(bundle: bundle)
        for (what, file) in [("encoder", manifest.files.encoder), ("decoder", manifest.files.decoder),
                             ("vocabulary", manifest.files.vocab)] {
            guard FileManager.default.fileExists(atPath: bundle.appendingPathComponent(file).path) else {
                throw BundleError.missingFile("the bundle has no \(what) (\(file)) in \(bundle.path)")
            }
        }
        let runtime = try runtime ?? CohereTranscriber.defaultRuntime()
        self.bundleURL = bundle
        self.manifest = manifest
        self.runtime = runtime
        self.computeUnits = computeUnits
        self.detokenizer = try Detokenizer(vocabURL: bundle.appendingPathComponent(manifest.files.vocab))
        self.eosIds = Set(manifest.tokens.eos_token_ids)
        let start = Date()
        let decoderURL = bundle.appendingPathComponent(manifest.files.decoder)
        let step = manifest.decoder.functions?.step ?? "main"
        decoder = try await runtime.loadModel(at: decoderURL, functionName: step == "main" ? nil : step,
                                              computeUnits: computeUnits.decoder)
        try CohereTranscriber.check(decoder, expected: manifest.expectedDecoderIO(), manifest: manifest,
                                    component: "decoder", function: step)
        if usePrefill, let name = manifest.decoder.functions?.prefill, let length = manifest.decoder.prefill_length {
            let model = try await runtime.loadModel(at: decoderURL, functionName: name, computeUnits: computeUnits.decoder)
            try CohereTranscriber.check(model, expected: manifest.expectedDecoderIO(prefillLength: length),
                                        manifest: manifest, component: "decoder", function: name)
            prefill = model
        } else {
            prefill = nil
        }
        loadSeconds = Date().timeIntervalSince(start)
        _ = try await encoder(function: "main")  // the full window: loaded and checked up front
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

    /// Core ML where it exists; elsewhere an error pointing at `InterpreterRuntime`.
    static func defaultRuntime() throws -> ModelRuntime {
        #if canImport(CoreML)
        return CoreMLRuntime()
        #else
        throw TranscriptionError.invalidArgument(
            "Core ML is not available on this platform: pass runtime: InterpreterRuntime() (cohere-coreml serve-runtime)")
        #endif
    }

    private func encoder(function: String) async throws -> RuntimeModel {
        if let model = encoders[function] { return model }
        guard let bucket = manifest.encoderBuckets.first(where: { $0.function == function }) else {
            throw BundleError.ioMismatch(component: "encoder", function: function, detail: "not in the manifest's encoder functions")
        }
        let start = Date()
        let model = try await runtime.loadModel(at: bundleURL.appendingPathComponent(manifest.files.encoder),
                                                functionName: function == "main" ? nil : function,
                                                computeUnits: computeUnits.encoder)
        loadSeconds += Date().timeIntervalSince(start)
        try CohereTranscriber.check(model, expected: manifest.expectedEncoderIO(frames: bucket.frames), manifest: manifest,
                                    component: "encoder", function: function)
        encoders[function] = model
        return model
    }

    static let noFrontEnd = BundleError.noFrontEnd(
        "the bundle has no front-end package (manifest files.frontend and frontend): re-export it with `cohere-coreml export` "
            + "(it writes frontend.mlpackage by default), or pass features to transcribeWindow(features:validFrames:prompt:)")

    private func frontEnd(function: String, samples: Int, frames: Int) async throws -> RuntimeModel {
        if let model = frontEnds[function] { return model }
        guard let file = manifest.files.frontend else { throw CohereTranscriber.noFrontEnd }
        let url = bundleURL.appendingPathComponent(file)
        guard FileManager.default.fileExists(atPath: url.path) else {
            throw BundleError.missingFile("the bundle has no front end (\(file)) in \(bundleURL.path)")
        }
        let start = Date()
        let model = try await runtime.loadModel(at: url, functionName: function == "main" ? nil : function,
                                                computeUnits: computeUnits.frontEnd)
        loadSeconds += Date().timeIntervalSince(start)
        try CohereTranscriber.check(model, expected: manifest.expectedFrontEndIO(samples: samples, frames: frames),
                                    manifest: manifest, component: "frontend", function: function)
        frontEnds[function] = model
        return model
    }

    /// Loads every encoder (and front-end) function now, so the first transcription does not pay for it.
    public func prewarm() async throws {
        for bucket in manifest.encoderBuckets {
            _ = try await encoder(function: bucket.function)
        }
        for (function, f) in manifest.frontend?.functions ?? [:] where manifest.files.frontend != nil {
            _ = try await frontEnd(function: function, samples: f.samples, frames: f.frames)
        }
    }

    // MARK: - whole clips

    public func transcribe(contentsOf url: URL, language: String, punctuation: Bool = true,
                           maxNewTokens: Int? = nil) async throws -> TranscriptionResult {
        let prompt = try manifest.prompt(language: language, punctuation: punctuation)  // unknown language: before any work
        let audio = try AudioInput.load(contentsOf: url, sampleRate: manifest.audio.sampling_rate)
        return try await transcribe(samples: audio.samples, language: language, punctuation: punctuation,
                                    maxNewTokens: maxNewTokens, name: url.path, prompt: prompt)
    }

    /// Transcribes mono Float samples at the bundle's sample rate (16 kHz).
    public func transcribe(samples: [Float], language: String, punctuation: Bool = true,
                           maxNewTokens: Int? = nil) async throws -> TranscriptionResult {
        let prompt = try manifest.prompt(language: language, punctuation: punctuation)
        return try await transcribe(samples: samples, language: language, punctuation: punctuation,
                                    maxNewTokens: maxNewTokens, name: "audio", prompt: prompt)
    }

    private func transcribe(samples: [Float], language: String, punctuation: Bool, maxNewTokens: Int?, name: String,
                            prompt: [Int]) async throws -> TranscriptionResult {
        if try AudioInput.isSilent(samples, name: name) {
            return TranscriptionResult(text: "", language: language, punctuation: punctuation, windows: [], silent: true,
                                       seconds: Double(samples.count) / Double(manifest.audio.sampling_rate))
        }
        let rate = Double(manifest.audio.sampling_rate)
        var windows: [WindowResult] = []
        for (i, range) in AudioSplitter.splitPoints(samples, manifest: manifest).enumerated() {
            let piece = Array(samples[range])
            let start = Date()
            let (features, valid) = try await features(of: piece)
            let featuresSeconds = Date().timeIntervalSince(start)
            var window = try await transcribeWindow(features: features, validFrames: valid, prompt: prompt,
                                                    maxNewTokens: maxNewTokens, index: i,
                                                    startSeconds: Double(range.lowerBound) / rate)
            window.durationSeconds = Double(piece.count) / rate
            window.timings.featuresSeconds = featuresSeconds
            windows.append(window)
        }
        let text = Detokenizer.joinWindows(windows.map(\.text), language: language,
                                           noSpaceLanguages: manifest.generation.no_space_languages)
        return TranscriptionResult(text: text, language: language, punctuation: punctuation, windows: windows,
                                   seconds: Double(samples.count) / rate)
    }

    /// Log-mel features of one piece through the front-end package: ((1, n_mels, frames) float32, valid frames),
    /// `frames` those of the smallest encoder bucket that holds the piece. As Python's
    /// `Transcriber.package_features`: the front-end function is the smallest whose window holds the samples
    /// and those frames; its features are cut to the encoder's frames (frames past the valid ones are zero).
    public func features(of piece: [Float]) async throws -> (Tensor, Int) {
        let a = manifest.audio
        let valid = (piece.count + 2 * (a.n_fft / 2) - a.n_fft) / a.hop_length
        guard valid >= 2 else {
            throw AudioError.invalid("audio is too short: \(piece.count) samples give \(max(valid, 0)) feature frame(s); at least \(2 * a.hop_length) samples are needed")
        }
        guard let bucket = manifest.encoderBuckets.first(where: { valid <= $0.frames }) else {
            throw AudioError.invalid("a piece of \(valid) feature frames does not fit the encoder window (\(a.window_frames)): split it with AudioSplitter")
        }
        guard manifest.files.frontend != nil, manifest.frontend != nil else { throw CohereTranscriber.noFrontEnd }
        guard let fn = manifest.frontEndFunction(samples: piece.count, frames: bucket.frames) else {
            throw AudioError.invalid("a piece of \(piece.count) samples does not fit the front end's longest window: split it with AudioSplitter")
        }
        let model = try await frontEnd(function: fn.function, samples: fn.samples, frames: fn.frames)
        var padded = piece
        padded.append(contentsOf: [Float](repeating: 0, count: fn.samples - piece.count))
        let out = try model.predict(["audio": try Tensor(float32: padded, shape: [1, fn.samples]),
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
    public func transcribeWindow(features: Tensor, validFrames: Int, prompt: [Int], maxNewTokens: Int? = nil,
                                 index: Int = 0, startSeconds: Double = 0) async throws -> WindowResult {
        let frames = features.shape.last ?? 0
        guard let bucket = manifest.encoderBuckets.first(where: { $0.frames == frames }) else {
            throw TranscriptionError.invalidArgument(
                "features have \(frames) frames; the encoder takes \(manifest.encoderBuckets.map { String($0.frames) }.joined(separator: " or "))")
        }
        let input = try Tensor(dtype: .float32, shape: [1, manifest.encoder.num_mel_bins, frames], data: features.data)
        let model = try await encoder(function: bucket.function)
        let t0 = Date()
        let encoded = try model.predict(["input_features": input,
                                         "feature_length": try Tensor(int32: [Int32(validFrames)], shape: [1])], state: nil)
        let encoderSeconds = Date().timeIntervalSince(t0)
        var cross: [String: Tensor] = [:]
        for name in ["cross_k", "cross_v", "cross_mask"] {
            guard let t = encoded[name] else { throw TranscriptionError.badOutput("the encoder package returned no \(name)") }
            cross[name] = t
        }
        let decoded = try decode(cross: cross, prompt: prompt, maxNewTokens: maxNewTokens)
        let text = try detokenizer.decode(decoded.tokens.filter { !eosIds.contains($0) })
        let calls = max(decoded.calls, 1)
        let timings = WindowTimings(featuresSeconds: 0, encoderSeconds: encoderSeconds, encoderFunction: bucket.function,
                                    promptSeconds: decoded.promptSeconds, decodeSeconds: decoded.decodeSeconds,
                                    decoderCalls: decoded.calls,
                                    msPerDecoderCall: 1000 * (decoded.promptSeconds + decoded.decodeSeconds) / Double(calls))
        return WindowResult(index: index, startSeconds: startSeconds,
                            durationSeconds: Double(validFrames * manifest.audio.hop_length) / Double(manifest.audio.sampling_rate),
                            tokenIds: decoded.tokens, text: text, truncated: decoded.stopReason != "eos",
                            stopReason: decoded.stopReason, timings: timings)
    }

    struct Decoded {
        var tokens: [Int]
        var stopReason: String
        var calls: Int
        var promptSeconds: Double
        var decodeSeconds: Double
    }

    /// The decoding loop of docs/bundle.md: fresh state, prompt (prefill when present), greedy to eos,
    /// the cache capacity or `maxNewTokens`.
    func decode(cross: [String: Tensor], prompt: [Int], maxNewTokens: Int?) throws -> Decoded {
        let capacity = manifest.decoder.capacity
        guard prompt.count < capacity else {
            throw TranscriptionError.invalidArgument("prompt of \(prompt.count) tokens does not fit the cache (\(capacity) slots)")
        }
        var limit = capacity - prompt.count + 1  // the last prediction is emitted without being fed
        var reasonAtLimit = "capacity"
        if let maxNewTokens {
            guard maxNewTokens >= 1 else { throw TranscriptionError.invalidArgument("maxNewTokens must be >= 1, got \(maxNewTokens)") }
            if maxNewTokens < limit { (limit, reasonAtLimit) = (maxNewTokens, "max_new_tokens") }
        }
        let output = manifest.decoder.output
        let state = try decoder.makeState()
        func logProbs(_ out: [String: Tensor]) throws -> [Float] {
            guard let t = out[output] else { throw TranscriptionError.badOutput("the decoder package returned no \(output)") }
            return t.floats()
        }
        func step(_ token: Int, _ position: Int) throws -> [Float] {
            var inputs = cross
            inputs["input_ids"] = try Tensor(int32: [Int32(token)], shape: [1, 1])
            inputs["position"] = try Tensor(int32: [Int32(position)], shape: [1])
            return try logProbs(try decoder.predict(inputs, state: state))
        }
        let t0 = Date()
        var calls = 0
        var scores: [Float] = []
        if let prefill, prompt.count == manifest.decoder.prefill_length {
            var inputs = cross
            inputs["input_ids"] = try Tensor(int32: prompt.map(Int32.init), shape: [1, prompt.count])
            scores = try logProbs(try prefill.predict(inputs, state: state))
            calls += 1
        } else {
            for (position, token) in prompt.enumerated() {
                scores = try step(token, position)
                calls += 1
            }
        }
        let t1 = Date()
        var tokens: [Int] = []
        var position = prompt.count
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
            if eosIds.contains(best) { stopReason = "eos"; break }
            if tokens.count >= limit { break }
            scores = try step(best, position)
            position += 1
            calls += 1
        }
        return Decoded(tokens: tokens, stopReason: stopReason, calls: calls, promptSeconds: t1.timeIntervalSince(t0),
                       decodeSeconds: Date().timeIntervalSince(t1))
    }
}
