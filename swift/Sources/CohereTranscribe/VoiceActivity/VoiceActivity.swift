import Foundation

/// Whether a transcription finds speech with the bundle's voice-activity package (docs/vad.md).
public enum VADMode: String, Sendable, CaseIterable, Codable {
    /// On when the bundle has `vad.mlpackage` (manifest `vad`), off otherwise.
    case auto
    /// On; a bundle without the package is an error naming how to export one.
    case on
    /// Off: the energy rules only (the whole audio is transcribed).
    case off

    /// Whether the VAD runs for a bundle with (`bundleHasVAD`) or without the package; `.on` without it throws.
    public func resolve(bundleHasVAD: Bool, bundle: URL) throws -> Bool {
        switch self {
        case .off: return false
        case .auto: return bundleHasVAD
        case .on:
            guard bundleHasVAD else { throw VoiceActivity.noVAD(bundle) }
            return true
        }
    }
}

/// Speech probabilities from the bundle's `vad.mlpackage` (Silero VAD's 16 kHz network; manifest `vad`,
/// docs/vad.md): one probability per 512-sample chunk. Each row of a call's `frames` (N, 576) is the 64
/// samples before a chunk, then its 512 samples; the network's recurrent state goes in and out of every
/// call as two plain (1, 128) float32 arrays (`h`, `c`), carried from call to call by the caller.
///
/// `block` scores a whole signal N chunks a call (N: the manifest's `vad.functions.block.chunks`, never
/// assumed), from a zero state; the last call's missing rows are zero frames whose outputs are dropped.
/// `chunk` (N = 1) scores a stream chunk by chunk (`VoiceActivity.Stream`).
public enum VoiceActivity {
    /// The whole-signal function (the package's default function).
    public static let blockFunction = "block"
    /// The stream's function: one chunk a call.
    public static let chunkFunction = "chunk"

    static func noVAD(_ bundle: URL) -> TranscriptionError {
        .invalidArgument("bundle \(bundle.path) has no vad.mlpackage: re-export with `cohere-coreml export --vad` (the default)")
    }

    /// Frames of `samples` for the package, row-major (rows x frameSamples): row i is the `context` samples
    /// before chunk i (for the first, `before`; zeros when empty), then chunk i's `chunk` samples, the last
    /// chunk zero-padded (Python's `model.silero.chunk_frames`).
    public static func frames(_ samples: ArraySlice<Float>, before: [Float], chunk: Int, context: Int) -> [Float] {
        let rows = (samples.count + chunk - 1) / chunk
        var padded = [Float](repeating: 0, count: context + rows * chunk)
        let lead = Array(before.suffix(context))
        padded.replaceSubrange((context - lead.count)..<context, with: lead)
        padded.replaceSubrange(context..<(context + samples.count), with: samples)
        var out = [Float](repeating: 0, count: rows * (context + chunk))
        for r in 0..<rows {
            out.replaceSubrange(r * (context + chunk)..<(r + 1) * (context + chunk),
                                with: padded[(r * chunk)..<(r * chunk + context + chunk)])
        }
        return out
    }

    /// One call of a VAD function on `rows` frames (rows x frameSamples, at most the function's chunks; the
    /// rest zero rows) with the state (h, c): the first `rows` probabilities and the state after the call.
    static func call(_ model: RuntimeModel, frames: ArraySlice<Float>, rows: Int, chunks: Int, frameSamples: Int,
                     h: [Float], c: [Float]) async throws -> (probabilities: [Float], h: [Float], c: [Float]) {
        var block = Array(frames)
        block.append(contentsOf: [Float](repeating: 0, count: chunks * frameSamples - block.count))
        let out = try await model.predict(["frames": try Tensor(float32: block, shape: [chunks, frameSamples]),
                                           "h": try Tensor(float32: h, shape: [1, h.count]),
                                           "c": try Tensor(float32: c, shape: [1, c.count])], state: nil)
        guard let p = out["probability"], p.count == chunks, let hOut = out["h_out"], hOut.count == h.count,
              let cOut = out["c_out"], cOut.count == c.count else {
            throw TranscriptionError.badOutput("the VAD package's \(model.functionName) function returned no (1, \(chunks)) "
                + "probability and (1, \(h.count)) h_out / c_out")
        }
        return (Array(p.floats().prefix(rows)), hOut.floats(), cOut.floats())
    }

    /// The probabilities of a whole signal (`ceil(samples / chunk)` of them) with the `block` function from a
    /// zero state, `vad.functions.block.chunks` rows a call, the state carried from call to call.
    public static func probabilities(_ samples: [Float], block model: RuntimeModel,
                                     vad: BundleManifest.VAD) async throws -> [Float] {
        guard let chunks = vad.functions[blockFunction]?.chunks, chunks >= 1 else {
            throw BundleError.invalidField(field: "vad.functions.block.chunks", problem: "is missing: re-export the bundle")
        }
        let frameSamples = vad.contextSamples + vad.chunkSamples
        let frames = frames(samples[...], before: [], chunk: vad.chunkSamples, context: vad.contextSamples)
        let rows = frames.count / frameSamples
        var h = [Float](repeating: 0, count: vad.hidden), c = h
        var out: [Float] = []
        out.reserveCapacity(rows)
        var row = 0
        while row < rows {
            try Task.checkCancellation()
            let n = min(chunks, rows - row)
            let r = try await call(model, frames: frames[(row * frameSamples)..<((row + n) * frameSamples)], rows: n,
                                   chunks: chunks, frameSamples: frameSamples, h: h, c: c)
            (h, c) = (r.h, r.c)
            out += r.probabilities
            row += n
        }
        return out
    }

    /// A stream's probabilities (Python's `ProbabilityStream`): `push(samples)` returns those of the chunks the
    /// samples complete, one `chunk` call each, carrying the state and the 64 samples of context; samples past
    /// the last whole chunk wait for the next push. Not Sendable: one task drives it.
    public final class Stream {
        let model: RuntimeModel
        let chunk: Int
        let context: Int
        private var pending: [Float] = []
        private var before: [Float]
        private var h: [Float]
        private var c: [Float]

        public init(chunk model: RuntimeModel, vad: BundleManifest.VAD) {
            self.model = model
            chunk = vad.chunkSamples
            context = vad.contextSamples
            before = [Float](repeating: 0, count: vad.contextSamples)
            h = [Float](repeating: 0, count: vad.hidden)
            c = h
        }

        /// The probabilities of the chunks these samples complete (possibly none).
        public func push(_ samples: [Float]) async throws -> [Float] {
            pending += samples
            var out: [Float] = []
            while pending.count >= chunk {
                let piece = pending[0..<chunk]
                let frame = VoiceActivity.frames(piece, before: before, chunk: chunk, context: context)
                let r = try await VoiceActivity.call(model, frames: frame[...], rows: 1, chunks: 1,
                                                     frameSamples: chunk + context, h: h, c: c)
                (h, c) = (r.h, r.c)
                before = Array(piece.suffix(context))
                pending.removeFirst(chunk)
                out += r.probabilities
            }
            return out
        }
    }
}

extension BundleManifest {
    /// What a VAD function of `chunks` rows must take and return (docs/vad.md): frames (chunks, context +
    /// chunk), h and c (1, hidden) in; probability (1, chunks), h_out and c_out (1, hidden) out; float32 always.
    public func expectedVADIO(chunks: Int) -> ModelIO? {
        guard let v = vad else { return nil }
        let state = ArrayDescription(shape: [1, v.hidden], dtype: "float32")
        return ModelIO(inputs: ["frames": .init(shape: [chunks, v.contextSamples + v.chunkSamples], dtype: "float32"),
                                "h": state, "c": state],
                       outputs: ["probability": .init(shape: [1, chunks], dtype: "float32"), "h_out": state, "c_out": state])
    }
}

extension CohereTranscriber {
    /// Whether `mode` runs the VAD with this bundle (`.on` without `vad.mlpackage`: an error naming the fix).
    public nonisolated func usesVAD(_ mode: VADMode) throws -> Bool {
        try mode.resolve(bundleHasVAD: manifest.vad != nil && manifest.files.vad != nil, bundle: bundleURL)
    }

    /// A function of the bundle's VAD package, loaded once and checked against the manifest.
    func vadModel(_ function: String) async throws -> (RuntimeModel, BundleManifest.VAD) {
        guard let vad = manifest.vad, let file = manifest.files.vad else { throw VoiceActivity.noVAD(bundleURL) }
        guard FileManager.default.fileExists(atPath: bundleURL.appendingPathComponent(file).path) else {
            throw BundleError.missingFile("the bundle has no VAD (\(file)) in \(bundleURL.path)")
        }
        guard let chunks = vad.functions[function]?.chunks, let expected = manifest.expectedVADIO(chunks: chunks) else {
            throw BundleError.invalidField(field: "vad.functions.\(function)", problem: "is missing: re-export the bundle")
        }
        // where the front end runs (audio in, small convolutions): the device choice's units for it apply
        let model = try await load("vad/\(function)", file: file, function: function, units: computeUnits.frontEnd,
                                           expected: expected, component: "vad")
        return (model, vad)
    }

    /// The speech probability of each 512-sample chunk of `samples` (16 kHz mono; the last chunk zero-padded),
    /// from the bundle's VAD package (`block` function).
    public func speechProbabilities(_ samples: [Float]) async throws -> [Float] {
        let (model, vad) = try await vadModel(VoiceActivity.blockFunction)
        return try await VoiceActivity.probabilities(samples, block: model, vad: vad)
    }

    /// The speech regions of `samples` (16 kHz mono) by the rule of docs/vad.md: the package's probabilities,
    /// regions at most one window long (`options.maxSpeechSeconds` when shorter than the bundle's window).
    public func speechRegions(_ samples: [Float], options: VADOptions = VADOptions()) async throws -> [SampleSpan] {
        try options.validate()
        let probabilities = try await speechProbabilities(samples)
        return CohereTranscribe.speechRegions(probabilities, sampleCount: samples.count, options: options.limited,
                                              maxSpeechSeconds: options.maxSpeech(forWindow: vadWindowSeconds))
    }

    /// The windows the transcriber encodes with the VAD on (Python's `longform.plan_speech`): the speech regions
    /// packed into windows of at most the bundle's window (`vadWindowSeconds`), pauses longer than
    /// `options.maxGapSeconds` left out; a window shorter than the front end's two frames widened with the
    /// audio before it (only options without a minimum speech length or pad make one).
    public func speechWindows(_ samples: [Float], options: VADOptions = VADOptions()) async throws
        -> (regions: [SampleSpan], windows: [SampleSpan]) {
        let a = manifest.audio
        let regions = try await speechRegions(samples, options: options)
        let windows = try packWindows(regions, sampleCount: samples.count,
                                      windowSamples: roundEven(vadWindowSeconds * Double(a.samplingRate)),
                                      maxGapSamples: options.maxGapSamples)
        return (regions, windows.map { $0.widened(to: 2 * a.hopLength, within: samples.count) })
    }

    /// The longest window, seconds (Python's `Transcriber.window_s`): `audio.max_audio_clip_s`, or less when the
    /// encoder's frames hold less.
    nonisolated var vadWindowSeconds: Double {
        let a = manifest.audio
        return min(a.maxAudioClipSeconds, Double(manifest.encoder.windowFrames * a.hopLength) / Double(a.samplingRate))
    }
}

extension SampleSpan {
    /// At least `samples` long: the start moved back (not before 0), then the end to start + samples (at most
    /// `total`); Python's `longform._at_least`.
    func widened(to samples: Int, within total: Int) -> SampleSpan {
        if count >= samples { return self }
        let start = max(0, end - samples)
        return SampleSpan(start: start, end: min(total, start + samples))
    }
}

extension VADOptions {
    /// These options with no own region limit (the caller passes the limit it computed).
    var limited: VADOptions {
        var o = self
        o.maxSpeechSeconds = nil
        return o
    }
}
