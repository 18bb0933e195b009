import Foundation
#if canImport(os)
import os
#endif

// Live transcription: partial and final text while the audio arrives. The method is Python's
// `cohere_coreml.inference.streaming` (docs/streaming.md, "The method, exactly"): for the same chunk schedule and
// the same backend outputs the updates are identical, field for field.
//
//   samples (any chunking) -> 10 ms frames -> Segmenter (frame power vs running noise floor, hangover)
//     -> open segment, at its hop schedule: features of the segment so far, ONE encoder call, a decode
//        with the confirmed tokens forced after the prompt; LocalAgreement-n  -> .partial
//     -> segment end: the offline transcription of its samples                 -> .final

/// Parameters of the segmenter and the hop schedule (Python's `StreamConfig`; defaults measured in
/// docs/streaming.md). Times in seconds, rounded to whole frames.
public struct StreamConfig: Sendable, Equatable, Codable {
    /// A frame is speech when its energy exceeds the running noise floor by more than this (dB).
    public var onDb: Double = 6.0
    /// The noise floor: minimum frame power over this trailing span.
    public var floorWindowSeconds: Double = 3.0
    /// A segment ends after this much non-speech.
    public var hangoverSeconds: Double = 0.3
    /// A segment starts this long before its first speech frame.
    public var prerollSeconds: Double = 0.1
    /// The next partial is max(hop, hopGrowth x segment length) after the last one.
    public var hopSeconds: Double = 0.5
    public var hopGrowth: Double = 0.5
    /// LocalAgreement-n.
    public var agreement: Int = 2

    public init(onDb: Double = 6.0, floorWindowSeconds: Double = 3.0, hangoverSeconds: Double = 0.3,
                prerollSeconds: Double = 0.1, hopSeconds: Double = 0.5, hopGrowth: Double = 0.5, agreement: Int = 2) {
        (self.onDb, self.floorWindowSeconds, self.hangoverSeconds, self.prerollSeconds) =
            (onDb, floorWindowSeconds, hangoverSeconds, prerollSeconds)
        (self.hopSeconds, self.hopGrowth, self.agreement) = (hopSeconds, hopGrowth, agreement)
    }

    /// Throws `TranscriptionError.invalidArgument` naming the first bad parameter.
    public func validate() throws {
        for (name, v) in [("floorWindowSeconds", floorWindowSeconds), ("hangoverSeconds", hangoverSeconds),
                          ("hopSeconds", hopSeconds)] where !(v.isFinite && v > 0) {
            throw TranscriptionError.invalidArgument("\(name) must be a positive number of seconds, got \(v)")
        }
        for (name, v) in [("prerollSeconds", prerollSeconds), ("hopGrowth", hopGrowth), ("onDb", onDb)]
        where !(v.isFinite && v >= 0) {
            throw TranscriptionError.invalidArgument("\(name) must be a finite number >= 0, got \(v)")
        }
        guard agreement >= 1 else {
            throw TranscriptionError.invalidArgument("agreement (LocalAgreement-n) must be an integer >= 1, got \(agreement)")
        }
    }
}

/// Python's `round(x)` to an Int: nearest, ties to even.
@inline(__always) func roundEven(_ x: Double) -> Int { Int(x.rounded(.toNearestOrEven)) }

/// Whole frames in `seconds` (nearest, ties to even; at least 1): Python's `frames_of`.
public func framesOf(_ seconds: Double, frameSamples: Int, sampleRate: Int) -> Int {
    max(1, roundEven(seconds * Double(sampleRate) / Double(frameSamples)))
}

/// Power of one frame: (sum of x^2 in sample order, in Double) / count + 1e-10 (Python's `frame_powers`).
public func framePower(_ frame: ArraySlice<Float>) -> Double {
    var sum = 0.0
    for x in frame {
        let d = Double(x)
        sum += d * d
    }
    return sum / Double(frame.count) + StreamingConstants.energyEpsilon
}

public enum StreamingConstants {
    public static let energyEpsilon = 1e-10
    /// A frame of lower power is never speech (`AudioInput.silencePeak` squared, in Double as Python's).
    public static let silencePower = 1e-4 * 1e-4
    /// Chunk size of the file source (Python's `FILE_CHUNK_S`).
    public static let fileChunkSeconds = 0.1
}

// MARK: - segmenter

/// What the segmenter decided at the end of one frame (absolute sample indices).
public struct SegmentEvent: Sendable, Equatable {
    public enum Kind: String, Sendable { case open, close, cut }
    public var kind: Kind
    /// The sample at which the decision is taken (the end of the frame).
    public var frameEnd: Int
    public var start: Int
    /// close / cut: the segment's end (exclusive).
    public var end: Int?
}

/// Frame-by-frame voice activity with a running noise floor and hangover (Python's `Segmenter`).
public struct Segmenter: Sendable {
    public let frame: Int
    public let floorFrames: Int
    public let hangoverFrames: Int
    public let preroll: Int
    public let onFactor: Double
    public let maxSegment: Int
    public let context: Int
    public let minEnergyWindow: Int

    /// Sliding minimum: (frame index, power) with increasing powers; `floorHead` is its first live entry.
    private var floor: [(Int, Double)] = []
    private var floorHead = 0
    /// Frames seen.
    public private(set) var k = 0
    /// The open segment's first sample.
    public private(set) var start: Int?
    public private(set) var previousEnd = 0
    public private(set) var silentRun = 0

    public var isOpen: Bool { start != nil }

    public init(config: StreamConfig, frameSamples: Int, sampleRate: Int, maxSegment: Int, overlapSeconds: Double,
                minEnergyWindow: Int) throws {
        try config.validate()
        frame = frameSamples
        floorFrames = framesOf(config.floorWindowSeconds, frameSamples: frame, sampleRate: sampleRate)
        hangoverFrames = framesOf(config.hangoverSeconds, frameSamples: frame, sampleRate: sampleRate)
        preroll = roundEven(config.prerollSeconds * Double(sampleRate) / Double(frame)) * frame
        onFactor = pow(10.0, config.onDb / 10.0)
        self.maxSegment = maxSegment
        context = max(1, roundEven(overlapSeconds * Double(sampleRate)))
        self.minEnergyWindow = minEnergyWindow
        guard maxSegment >= 2 * frame else {
            throw TranscriptionError.invalidArgument("a segment of at most \(maxSegment) samples cannot hold two frames")
        }
    }

    /// One frame's power -> the event it causes, if any. `audio(a, b)` returns samples [a, b) (for a cut).
    public mutating func push(_ power: Double, audio: (Int, Int) throws -> [Float]) rethrows -> SegmentEvent? {
        let k = self.k
        self.k += 1
        while floor.count > floorHead, floor[floor.count - 1].1 >= power { floor.removeLast() }
        floor.append((k, power))
        while floor[floorHead].0 <= k - floorFrames { floorHead += 1 }
        if floorHead > 4096 { floor.removeFirst(floorHead); floorHead = 0 }
        let noiseFloor = floor[floorHead].1
        let speech = power > noiseFloor * onFactor && power > StreamingConstants.silencePower
        let frameEnd = (k + 1) * frame
        guard let start else {
            guard speech else { return nil }
            let s = max(previousEnd, k * frame - preroll)
            self.start = s
            silentRun = 0
            return SegmentEvent(kind: .open, frameEnd: frameEnd, start: s)
        }
        silentRun = speech ? 0 : silentRun + 1
        if silentRun >= hangoverFrames {
            (self.start, previousEnd) = (nil, frameEnd)
            return SegmentEvent(kind: .close, frameEnd: frameEnd, start: start, end: frameEnd)
        }
        if frameEnd - start >= maxSegment {
            let cut = try Self.cutPoint(start: start, maxSegment: maxSegment, context: context,
                                        minEnergyWindow: minEnergyWindow, frame: frame, audio: audio)
            (self.start, previousEnd) = (cut, cut)
            return SegmentEvent(kind: .cut, frameEnd: frameEnd, start: start, end: cut)
        }
        return nil
    }

    /// Where a segment from `start` that reached `maxSegment` is cut: split_points' rule for a piece starting
    /// at `start` (AudioSplitter: the quietest window in the last `context` samples), at least two frames in.
    static func cutPoint(start: Int, maxSegment: Int, context: Int, minEnergyWindow: Int, frame: Int,
                         audio: (Int, Int) throws -> [Float]) rethrows -> Int {
        let x = try audio(start, start + maxSegment)
        let cut = start + AudioSplitter.quietest(x, start: max(0, maxSegment - context), end: maxSegment,
                                                 window: minEnergyWindow)
        return max(start + 2 * frame, min(cut, start + maxSegment))
    }

    /// End of the audio: the open segment (if any) closes at `total`.
    public mutating func finish(total: Int) -> SegmentEvent? {
        guard let start else { return nil }
        (self.start, previousEnd) = (nil, total)
        return SegmentEvent(kind: .close, frameEnd: total, start: start, end: total)
    }
}

// MARK: - LocalAgreement

public enum LocalAgreement {
    /// Longest common prefix of token sequences ([] for none).
    public static func commonPrefix(_ sequences: [[Int]]) -> [Int] {
        guard let first = sequences.first else { return [] }
        var out: [Int] = []
        for (i, token) in first.enumerated() {
            guard sequences.allSatisfy({ $0.count > i && $0[i] == token }) else { break }
            out.append(token)
        }
        return out
    }

    /// LocalAgreement-n: the longest common prefix of the last n hypotheses (`confirmed` while fewer than n
    /// exist). A result that does not extend `confirmed` is a caller error.
    public static func confirm(_ hypotheses: [[Int]], n: Int, confirmed: [Int] = []) throws -> [Int] {
        guard n >= 1 else { throw TranscriptionError.invalidArgument("LocalAgreement-n needs n >= 1, got \(n)") }
        guard hypotheses.count >= n else { return confirmed }
        let agreed = commonPrefix(Array(hypotheses.suffix(n)))
        guard agreed.starts(with: confirmed) else {
            throw TranscriptionError.invalidArgument("a hypothesis does not start with the confirmed tokens it was decoded with")
        }
        return agreed
    }
}

// MARK: - updates and counters

/// One update of the stream; its JSON is the line of `cohere-coreml transcribe --stream --json`.
public struct StreamUpdate: Sendable, Codable, Equatable {
    public enum Kind: String, Sendable, Codable { case partial, final }
    public var type: Kind
    /// 0, 1, ... in order.
    public var segment: Int
    /// Seconds of audio received when emitted (the decision's frame boundary).
    public var audioTime: Double
    /// The segment's first sample, seconds.
    public var start: Double
    /// The end of the audio it covers, seconds (final: the segment's end).
    public var end: Double
    public var text: String
    /// The segment's tokens shown (eos excluded): confirmed + partial tail, or the final transcription.
    public var tokenIds: [Int]
    /// A prefix of `tokenIds` (all of them for a final).
    public var confirmedTokenIds: [Int]
    /// A final's words, times on the stream's timeline (nil: a partial, or word timings not asked).
    public var words: [WordTiming]?

    enum CodingKeys: String, CodingKey {
        case type, segment, start, end, text, words
        case audioTime = "audio_time"
        case tokenIds = "token_ids"
        case confirmedTokenIds = "confirmed_token_ids"
    }

    public init(type: Kind, segment: Int, audioTime: Double, start: Double, end: Double, text: String, tokenIds: [Int],
                confirmedTokenIds: [Int], words: [WordTiming]? = nil) {
        (self.type, self.segment, self.audioTime, self.start, self.end) = (type, segment, audioTime, start, end)
        (self.text, self.tokenIds, self.confirmedTokenIds, self.words) = (text, tokenIds, confirmedTokenIds, words)
    }

    /// One JSON line, keys in Python's order (type, segment, audio_time, start, end, text, token_ids,
    /// confirmed_token_ids, then a final's words when asked: times and probabilities to 3 decimals, as Python
    /// prints them), floats as Swift's shortest round-trip representation.
    public func jsonLine() -> String {
        func ids(_ a: [Int]) -> String { "[" + a.map(String.init).joined(separator: ", ") + "]" }
        func r(_ x: Double) -> Double { (x * 1000).rounded() / 1000 }
        let words = self.words.map { words in
            ", \"words\": [" + words.map {
                "{\"word\": \(JSONValue.quoted($0.text)), \"start\": \(r($0.start)), \"end\": \(r($0.end)), "
                    + "\"probability\": \(r($0.probability))}"
            }.joined(separator: ", ") + "]"
        } ?? ""
        return "{\"type\": \"\(type.rawValue)\", \"segment\": \(segment), \"audio_time\": \(audioTime), "
            + "\"start\": \(start), \"end\": \(end), \"text\": \(JSONValue.quoted(text)), \"token_ids\": \(ids(tokenIds)), "
            + "\"confirmed_token_ids\": \(ids(confirmedTokenIds))\(words)}"
    }
}

/// Compute spent (counted, not timed), Python's `StreamStats`; its JSON (keys as Python's) is the line of
/// `--stream --stats`.
public struct StreamStats: Sendable, Codable, Equatable {
    public var audioSeconds = 0.0
    public var encoderCalls = 0
    /// Mel frames of the encoder functions called (bucket sizes) and the valid ones.
    public var encoderFrames = 0
    public var encoderValidFrames = 0
    /// Decoder calls (prefill, extend or step predictions) and the token slots they computed (prefill P,
    /// extend K with its padding, step 1).
    public var decoderCalls = 0
    public var decoderTokens = 0
    public var partials = 0
    public var finals = 0
    /// The finals' share (= the offline transcription of the segments).
    public var finalEncoderFrames = 0
    public var finalDecoderCalls = 0
    public var finalDecoderTokens = 0
    public var frameSeconds = 0.01

    enum CodingKeys: String, CodingKey {
        case partials, finals
        case audioSeconds = "audio_s"
        case encoderCalls = "encoder_calls"
        case encoderFrames = "encoder_frames"
        case encoderValidFrames = "encoder_valid_frames"
        case decoderCalls = "decoder_calls"
        case decoderTokens = "decoder_tokens"
        case finalEncoderFrames = "final_encoder_frames"
        case finalDecoderCalls = "final_decoder_calls"
        case finalDecoderTokens = "final_decoder_tokens"
        case frameSeconds = "frame_seconds"
    }

    /// Per audio second: encoder calls, encoder audio-seconds, valid audio-seconds, decoder calls and tokens fed
    /// (Python's `per_audio_second`, in its key order).
    public var perAudioSecond: KeyValuePairs<String, Double> {
        let s = max(audioSeconds, 1e-9)
        return ["encoder_calls": Double(encoderCalls) / s, "encoder_audio_s": Double(encoderFrames) * frameSeconds / s,
                "encoder_valid_audio_s": Double(encoderValidFrames) * frameSeconds / s,
                "decoder_calls": Double(decoderCalls) / s, "decoder_tokens": Double(decoderTokens) / s]
    }

    /// The `--stats` line as Python's `streaming.stats_line` prints it: {"type": "stats"[, "audio"], the counters,
    /// "per_audio_second": {...}}, keys in Python's order.
    public func jsonLine(audio: String? = nil) -> String {
        let counters: [(String, String)] = [
            ("audio_s", "\(audioSeconds)"), ("encoder_calls", "\(encoderCalls)"), ("encoder_frames", "\(encoderFrames)"),
            ("encoder_valid_frames", "\(encoderValidFrames)"), ("decoder_calls", "\(decoderCalls)"),
            ("decoder_tokens", "\(decoderTokens)"), ("partials", "\(partials)"), ("finals", "\(finals)"),
            ("final_encoder_frames", "\(finalEncoderFrames)"), ("final_decoder_calls", "\(finalDecoderCalls)"),
            ("final_decoder_tokens", "\(finalDecoderTokens)"), ("frame_seconds", "\(frameSeconds)")]
        let rates = perAudioSecond.map { "\"\($0.key)\": \($0.value)" }.joined(separator: ", ")
        let head = "{\"type\": \"stats\", " + (audio.map { "\"audio\": \(JSONValue.quoted($0)), " } ?? "")
        return head + counters.map { "\"\($0.0)\": \($0.1)" }.joined(separator: ", ") + ", \"per_audio_second\": {\(rates)}}"
    }
}

// MARK: - the session

/// Live transcription of one audio stream (the synchronous core of `CohereTranscriber.stream`):
///
///     let session = try StreamingSession(transcriber: t, language: "en")
///     for chunk in chunks { for u in try await session.feed(chunk) { ... } }   // 16 kHz mono Float
///     for u in try await session.finish() { ... }                               // the open segment's final
///
/// Not Sendable: one task drives it; every model call runs on the transcriber actor.
public final class StreamingSession {
    public let transcriber: CohereTranscriber
    public let config: StreamConfig
    public let language: String
    public let prompt: [Int]
    public let maxNewTokens: Int?
    /// Finals carry their words (`StreamUpdate.words`).
    public let wordTimestamps: Bool
    public private(set) var stats: StreamStats
    public let sampleRate: Int
    public let frame: Int
    public let hop: Int

    private var segmenter: any StreamSegmenter
    /// With the VAD: the segmenter's probabilities (the package's chunk function), loaded at the first feed.
    private var vadStream: VoiceActivity.Stream?
    /// Segments opened and closed by the bundle's VAD (`VADSegmenter`), else by frame energy (`Segmenter`).
    public let usesVAD: Bool
    private let capacity: Int
    private let eosIds: Set<Int>
    private var audio: [Float] = []  // samples from absolute index `offset`
    private var offset = 0
    private var received = 0
    private var segment: OpenSegment?
    private var count = 0
    private var finished = false

    struct OpenSegment {
        var index: Int
        var start: Int
        var nextPartial: Int
        var hypotheses: [[Int]] = []
        var confirmed: [Int] = []
    }

    /// `wordTimestamps`: each final with its words (the bundle's `decoder.alignment`; checked now).
    /// `vad` (`.auto`: when the bundle has vad.mlpackage) and `vadOptions`: segments opened and closed by the
    /// bundle's VAD (docs/vad.md), else by frame energy (`config`'s segmenter parameters).
    public init(transcriber: CohereTranscriber, language: String, punctuation: Bool = true,
                config: StreamConfig = StreamConfig(), maxNewTokens: Int? = nil, wordTimestamps: Bool = false,
                vad: VADMode = .auto, vadOptions: VADOptions = VADOptions()) throws {
        let m = transcriber.manifest
        let a = m.audio
        self.transcriber = transcriber
        self.config = config
        self.language = language
        self.prompt = try m.prompt(language: language, punctuation: punctuation)
        self.maxNewTokens = maxNewTokens
        self.wordTimestamps = wordTimestamps
        if wordTimestamps { _ = try m.checkedAlignment(promptLength: prompt.count) }
        sampleRate = a.samplingRate
        frame = a.hopLength
        let windowSamples = m.encoder.windowFrames * frame
        let maxSegment = min(roundEven(a.maxAudioClipSeconds * Double(sampleRate)), windowSamples)
        usesVAD = try transcriber.checkedVAD(vad, options: vadOptions)
        if usesVAD {
            try config.validate()
            segmenter = try VADSegmenter(options: vadOptions, frameSamples: frame, sampleRate: sampleRate,
                                         maxSegment: maxSegment, overlapSeconds: a.overlapChunkSeconds,
                                         minEnergyWindow: a.minEnergyWindowSamples)
        } else {
            segmenter = try Segmenter(config: config, frameSamples: frame, sampleRate: sampleRate, maxSegment: maxSegment,
                                      overlapSeconds: a.overlapChunkSeconds, minEnergyWindow: a.minEnergyWindowSamples)
        }
        hop = framesOf(config.hopSeconds, frameSamples: frame, sampleRate: sampleRate) * frame
        capacity = m.decoder.capacity
        eosIds = Set(m.tokens.eosTokenIds)
        stats = StreamStats(frameSeconds: Double(frame) / Double(sampleRate))
    }

    /// Appends samples (Float mono at the bundle's rate); the updates their frames caused.
    public func feed(_ samples: [Float]) async throws -> [StreamUpdate] {
        guard !finished else { throw TranscriptionError.invalidArgument("the stream is finished: start a new session") }
        if samples.isEmpty { return [] }
        let bad = samples.reduce(0) { $0 + ($1.isFinite ? 0 : 1) }
        if bad > 0 { throw AudioError.invalid("streamed audio chunk holds \(bad) NaN/inf sample(s) of \(samples.count)") }
        audio.append(contentsOf: samples)
        received += samples.count
        if usesVAD, var vad = segmenter as? VADSegmenter {  // the chunks these samples complete, scored first
            if vadStream == nil {
                let (model, entry) = try await transcriber.vadModel(VoiceActivity.chunkFunction)
                vadStream = VoiceActivity.Stream(chunk: model, vad: entry)
            }
            vad.add(probabilities: try await vadStream!.push(samples))
            segmenter = vad
        }
        var updates: [StreamUpdate] = []
        let first = segmenter.k
        let last = received / frame
        for k in first..<max(first, last) {
            let a = k * frame - offset
            let power = framePower(audio[a..<a + frame])
            updates += try await onFrame(power, frameEnd: (k + 1) * frame)
        }
        trim()
        return updates
    }

    /// End of the audio: the final of the open segment (the samples after the last whole frame included).
    public func finish() async throws -> [StreamUpdate] {
        if finished { return [] }
        finished = true
        stats.audioSeconds = Double(received) / Double(sampleRate)
        guard let event = segmenter.finish(total: received) else { return [] }
        return [try await final(start: event.start, end: event.end ?? received, now: received)]
    }

    private func onFrame(_ power: Double, frameEnd: Int) async throws -> [StreamUpdate] {
        stats.audioSeconds = Double(frameEnd) / Double(sampleRate)
        guard let event = try segmenter.push(power, audio: { try self.slice($0, $1) }) else {
            if let segment, frameEnd >= segment.nextPartial { return try await partial(now: frameEnd) }
            return []
        }
        switch event.kind {
        case .open:
            open(start: event.start, now: frameEnd)
            return []
        case .close, .cut:
            let update = try await final(start: event.start, end: event.end ?? frameEnd, now: frameEnd)
            if event.kind == .cut, let end = event.end { open(start: end, now: frameEnd) }
            return [update]
        }
    }

    private func open(start: Int, now: Int) {
        segment = OpenSegment(index: count, start: start, nextPartial: now + hop)
        count += 1
    }

    private func partial(now: Int) async throws -> [StreamUpdate] {
        guard var seg = segment else { return [] }
        let length = now - seg.start
        let growth = Int((config.hopGrowth * Double(length) / Double(frame)).rounded(.down)) * frame
        seg.nextPartial = now + max(hop, growth)
        segment = seg
        let forced = prompt + seg.confirmed
        if forced.count >= capacity - 1 { return [] }  // no room left to decode after the forced prefix
        let (features, valid) = try await transcriber.features(of: try slice(seg.start, now))
        // the last hypothesis' unconfirmed tail as the draft (verified, never forced), as Python's
        let draft = seg.hypotheses.last.map { Array($0.dropFirst(seg.confirmed.count)) } ?? []
        let window = try await transcriber.transcribeWindow(features: features, validFrames: valid, prompt: forced,
                                                            maxNewTokens: maxNewTokens, index: seg.index,
                                                            startSeconds: Double(seg.start) / Double(sampleRate),
                                                            draft: draft)
        stats.encoderCalls += 1
        stats.encoderFrames += features.shape.last ?? 0
        stats.encoderValidFrames += valid
        stats.decoderCalls += window.timings.decoderCalls
        stats.decoderTokens += window.timings.decoderTokensFed
        stats.partials += 1
        let hypothesis = seg.confirmed + window.tokenIds.filter { !eosIds.contains($0) }
        seg.hypotheses.append(hypothesis)
        seg.confirmed = try LocalAgreement.confirm(seg.hypotheses, n: config.agreement, confirmed: seg.confirmed)
        seg.hypotheses = Array(seg.hypotheses.suffix(config.agreement))
        segment = seg
        let text = try await transcriber.text(of: hypothesis)
        let sr = Double(sampleRate)
        return [StreamUpdate(type: .partial, segment: seg.index, audioTime: Double(now) / sr, start: Double(seg.start) / sr,
                             end: Double(now) / sr, text: text, tokenIds: hypothesis, confirmedTokenIds: seg.confirmed)]
    }

    /// The offline transcription of [start, end): the features, bucket, encoder and greedy decode of
    /// `CohereTranscriber.transcribe(samples:)` for a piece that is one window.
    private func final(start: Int, end: Int, now: Int) async throws -> StreamUpdate {
        guard let seg = segment else { throw TranscriptionError.invalidArgument("internal: a final without a segment") }
        let sr = Double(sampleRate)
        let (features, valid) = try await transcriber.features(of: try slice(start, end))
        let window = try await transcriber.transcribeWindow(features: features, validFrames: valid, prompt: prompt,
                                                            maxNewTokens: maxNewTokens, index: seg.index,
                                                            startSeconds: Double(start) / sr,
                                                            durationSeconds: Double(end - start) / sr, language: language,
                                                            wordTimestamps: wordTimestamps)
        let frames = features.shape.last ?? 0
        stats.encoderCalls += 1
        stats.encoderFrames += frames
        stats.finalEncoderFrames += frames
        stats.encoderValidFrames += valid
        stats.decoderCalls += window.timings.decoderCalls
        stats.finalDecoderCalls += window.timings.decoderCalls
        stats.decoderTokens += window.timings.decoderTokensFed
        stats.finalDecoderTokens += window.timings.decoderTokensFed
        stats.finals += 1
        let ids = window.tokenIds.filter { !eosIds.contains($0) }
        segment = nil
        return StreamUpdate(type: .final, segment: seg.index, audioTime: Double(now) / sr, start: Double(start) / sr,
                            end: Double(end) / sr, text: window.text, tokenIds: ids, confirmedTokenIds: ids,
                            words: window.words)
    }

    private func slice(_ a: Int, _ b: Int) throws -> [Float] {
        guard a >= offset, b <= offset + audio.count, a <= b else {
            throw TranscriptionError.invalidArgument(
                "internal: samples [\(a), \(b)) are not buffered ([\(offset), \(offset + audio.count)))")
        }
        return Array(audio[(a - offset)..<(b - offset)])
    }

    /// Keeps the open segment (or the pre-roll before the next one) and the partial frame.
    private func trim() {
        let framesEnd = segmenter.k * frame
        var keep = segmenter.start ?? max(segmenter.previousEnd, framesEnd - segmenter.preroll)
        keep = min(keep, framesEnd)
        if keep > offset {
            audio.removeFirst(keep - offset)
            offset = keep
        }
    }
}

// MARK: - the async API

extension CohereTranscriber {
    /// The text of token ids (special tokens skipped), as in a window's text.
    func text(of ids: [Int]) throws -> String { try detokenizer.decode(ids) }

    /// Live transcription: yield 16 kHz mono Float chunks (any sizes) into `input` and `finish()` it; `updates`
    /// delivers every partial and final (the open segment's final after `input.finish()`), then ends. A
    /// session error ends `updates` with that error; dropping the consumer cancels the work. The language,
    /// punctuation and configuration are checked now. `onStats` receives the session's counters after the
    /// last update (before `updates` ends).
    public nonisolated func stream(language: String, punctuation: Bool = true, config: StreamConfig = StreamConfig(),
                                   maxNewTokens: Int? = nil, wordTimestamps: Bool = false, vad: VADMode = .auto,
                                   vadOptions: VADOptions = VADOptions(),
                                   onStats: (@Sendable (StreamStats) -> Void)? = nil) throws
        -> (input: AsyncStream<[Float]>.Continuation, updates: AsyncThrowingStream<StreamUpdate, Error>) {
        let prompt = try manifest.prompt(language: language, punctuation: punctuation)
        if wordTimestamps { _ = try manifest.checkedAlignment(promptLength: prompt.count) }
        _ = try checkedVAD(vad, options: vadOptions)
        try config.validate()
        let (chunks, input) = AsyncStream<[Float]>.makeStream(bufferingPolicy: .unbounded)
        let (updates, output) = AsyncThrowingStream<StreamUpdate, Error>.makeStream(bufferingPolicy: .unbounded)
        let task = Task {
            do {
                let session = try StreamingSession(transcriber: self, language: language, punctuation: punctuation,
                                                   config: config, maxNewTokens: maxNewTokens,
                                                   wordTimestamps: wordTimestamps, vad: vad, vadOptions: vadOptions)
                for await chunk in chunks {
                    try Task.checkCancellation()
                    for update in try await session.feed(chunk) { output.yield(update) }
                }
                try Task.checkCancellation()
                for update in try await session.finish() { output.yield(update) }
                onStats?(session.stats)
                #if canImport(os)
                let stats = session.stats
                Logger(subsystem: "CohereTranscribe", category: "stream").info(
                    "stream: \(stats.finals) finals, \(stats.partials) partials, \(stats.encoderCalls) encoder calls over \(stats.audioSeconds) s")
                #endif
                output.finish()
            } catch {
                output.finish(throwing: error)
            }
        }
        output.onTermination = { _ in task.cancel() }
        return (input, updates)
    }
}

// MARK: - sources

/// A file fed to a stream in 0.1 s chunks (Python's `iter_file`): paced at real time (chunk i no earlier than
/// i x 0.1 s after the first) or as fast as possible. The file is read and resampled as `transcribe` reads it.
public enum StreamFileSource {
    /// `samples` in chunks of `chunkSeconds` (the last one shorter).
    public static func chunks(of samples: [Float], sampleRate: Int,
                              chunkSeconds: Double = StreamingConstants.fileChunkSeconds) -> [ArraySlice<Float>] {
        let chunk = max(1, roundEven(chunkSeconds * Double(sampleRate)))
        return stride(from: 0, to: samples.count, by: chunk).map { samples[$0..<min($0 + chunk, samples.count)] }
    }

    /// Feeds `url` into `input` (then finishes it); paced when `pace`. Cancelling the task stops feeding.
    public static func feed(contentsOf url: URL, sampleRate: Int, into input: AsyncStream<[Float]>.Continuation,
                            pace: Bool = true, chunkSeconds: Double = StreamingConstants.fileChunkSeconds) async throws {
        let audio: AudioSamples
        do {
            audio = try AudioInput.load(contentsOf: url, sampleRate: sampleRate)
        } catch {
            input.finish()
            throw error
        }
        try await feed(samples: audio.samples, sampleRate: sampleRate, into: input, pace: pace, chunkSeconds: chunkSeconds)
    }

    /// Feeds `samples` into `input` in chunks (then finishes it); paced when `pace`.
    public static func feed(samples: [Float], sampleRate: Int, into input: AsyncStream<[Float]>.Continuation,
                            pace: Bool = true, chunkSeconds: Double = StreamingConstants.fileChunkSeconds) async throws {
        defer { input.finish() }
        let t0 = Date()
        var position = 0
        for piece in chunks(of: samples, sampleRate: sampleRate, chunkSeconds: chunkSeconds) {
            try Task.checkCancellation()
            if pace {
                let wait = Double(position) / Double(sampleRate) - Date().timeIntervalSince(t0)
                if wait > 0 { try await Task.sleep(nanoseconds: UInt64(wait * 1e9)) }
            }
            input.yield(Array(piece))
            position += piece.count
        }
    }
}
