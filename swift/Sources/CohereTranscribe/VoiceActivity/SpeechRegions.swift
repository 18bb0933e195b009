import Foundation

// The speech-region rule of docs/vad.md: speech probabilities (one per 512-sample chunk of 16 kHz audio, from
// the bundle's vad.mlpackage) -> speech regions -> the windows the transcriber encodes, and the stream's
// start / end events. Python's `cohere_coreml.inference.speech_regions` and example_inference.py port the same
// rule; all three pass every case of tests/data/vad_vectors.json exactly (integers).
//
// `speechRegions` is an exact port of silero-vad 6.2.3's `get_speech_timestamps_from_probs` and `StreamVAD` of
// its `VADIterator.__call__` (https://github.com/snakers4/silero-vad, src/silero_vad/utils_vad.py, MIT): the
// same steps and the same float64 arithmetic (durations in samples as doubles, probabilities compared as
// doubles, padding truncated to integers as Python's int()).

/// Options of the speech-region rule, Silero VAD's defaults (Python's `VadOptions`; JSON keys as Python's).
public struct VADOptions: Sendable, Equatable, Codable {
    /// A chunk is speech at a probability >= this.
    public var threshold: Double = 0.5
    /// Speech ends below this probability; nil: max(threshold - 0.15, 0.01).
    public var negThreshold: Double?
    /// A region shorter than this is dropped.
    public var minSpeechMs: Int = 250
    /// A region ends after this much silence.
    public var minSilenceMs: Int = 100
    /// Each region is widened by this much on both sides (less where two regions nearly touch).
    public var speechPadMs: Int = 30
    /// The longest region, seconds; nil: the bundle's window (`audio.max_audio_clip_s`), so a region fits a window.
    public var maxSpeechSeconds: Double?
    /// The longest pause kept inside one window; longer pauses are never encoded.
    public var maxGapSeconds: Double = 2.0

    public init(threshold: Double = 0.5, negThreshold: Double? = nil, minSpeechMs: Int = 250, minSilenceMs: Int = 100,
                speechPadMs: Int = 30, maxSpeechSeconds: Double? = nil, maxGapSeconds: Double = 2.0) {
        (self.threshold, self.negThreshold, self.minSpeechMs, self.minSilenceMs) =
            (threshold, negThreshold, minSpeechMs, minSilenceMs)
        (self.speechPadMs, self.maxSpeechSeconds, self.maxGapSeconds) = (speechPadMs, maxSpeechSeconds, maxGapSeconds)
    }

    enum CodingKeys: String, CodingKey {
        case threshold
        case negThreshold = "neg_threshold"
        case minSpeechMs = "min_speech_ms"
        case minSilenceMs = "min_silence_ms"
        case speechPadMs = "speech_pad_ms"
        case maxSpeechSeconds = "max_speech_s"
        case maxGapSeconds = "max_gap_s"
    }

    /// Missing keys take the defaults (Python's `VadOptions.from_dict`).
    public init(from decoder: Decoder) throws {
        let c = try decoder.container(keyedBy: CodingKeys.self)
        let d = VADOptions()
        threshold = try c.decodeIfPresent(Double.self, forKey: .threshold) ?? d.threshold
        negThreshold = try c.decodeIfPresent(Double.self, forKey: .negThreshold)
        minSpeechMs = try c.decodeIfPresent(Int.self, forKey: .minSpeechMs) ?? d.minSpeechMs
        minSilenceMs = try c.decodeIfPresent(Int.self, forKey: .minSilenceMs) ?? d.minSilenceMs
        speechPadMs = try c.decodeIfPresent(Int.self, forKey: .speechPadMs) ?? d.speechPadMs
        maxSpeechSeconds = try c.decodeIfPresent(Double.self, forKey: .maxSpeechSeconds)
        maxGapSeconds = try c.decodeIfPresent(Double.self, forKey: .maxGapSeconds) ?? d.maxGapSeconds
    }

    /// The probability below which speech ends in `speechRegions`.
    public var resolvedNegThreshold: Double { negThreshold ?? max(threshold - 0.15, 0.01) }

    /// The longest region for a window of `windowSeconds`: `maxSpeechSeconds` when set and shorter, else the window.
    public func maxSpeech(forWindow windowSeconds: Double) -> Double {
        maxSpeechSeconds.map { min($0, windowSeconds) } ?? windowSeconds
    }

    /// `maxGapSeconds` in 16 kHz samples (nearest, ties to even: Python's round).
    public var maxGapSamples: Int { Int((maxGapSeconds * Double(VoiceActivityRule.sampleRate)).rounded(.toNearestOrEven)) }

    /// Throws `TranscriptionError.invalidArgument` naming the first option out of range (Python's checks).
    public func validate() throws {
        func bad(_ message: String) -> TranscriptionError { .invalidArgument(message) }
        guard threshold > 0, threshold < 1 else {
            throw bad("VAD threshold must be between 0 and 1 (exclusive), got \(threshold)")
        }
        if let negThreshold, !(negThreshold >= 0 && negThreshold <= threshold) {
            throw bad("VAD neg_threshold must be between 0 and the threshold \(threshold), got \(negThreshold)")
        }
        for (name, value) in [("min_speech_ms", minSpeechMs), ("min_silence_ms", minSilenceMs), ("speech_pad_ms", speechPadMs)]
        where value < 0 {
            throw bad("VAD \(name) must be a whole number of milliseconds >= 0, got \(value)")
        }
        if let maxSpeechSeconds, !(maxSpeechSeconds > 0) {
            throw bad("VAD max_speech_s must be > 0 seconds, got \(maxSpeechSeconds)")
        }
        guard maxGapSeconds >= 0, maxGapSeconds.isFinite else {
            throw bad("VAD max_gap_s must be >= 0 seconds, got \(maxGapSeconds)")
        }
    }
}

/// A stretch of the 16 kHz signal, samples [start, end).
public struct SampleSpan: Sendable, Equatable, Hashable, Codable, CustomStringConvertible {
    public var start: Int
    public var end: Int

    public init(start: Int, end: Int) {
        (self.start, self.end) = (start, end)
    }

    public var count: Int { end - start }
    public var description: String { "[\(start), \(end))" }
}

/// The rule's fixed numbers (Silero VAD's 16 kHz model).
public enum VoiceActivityRule {
    public static let sampleRate = 16000
    /// Samples of one chunk, one probability each.
    public static let chunkSamples = 512
    /// get_speech_timestamps_from_probs' default: a silence inside over-long speech counts as a cut point when
    /// longer than this.
    static let minSilenceAtMaxSpeechMs = 98
}

/// Speech regions, samples of a signal of `sampleCount` samples whose 512-sample chunks have these
/// probabilities (the last chunk zero-padded): silero-vad's `get_speech_timestamps_from_probs` at 16 kHz
/// with `min_silence_at_max_speech` 98 and `use_max_poss_sil_at_max_speech` True, line for line.
/// `maxSpeechSeconds`: the longest region when `options.maxSpeechSeconds` is nil (the caller passes the
/// bundle's window); both nil: no limit.
public func speechRegions<P: Collection>(_ probabilities: P, sampleCount: Int, options: VADOptions = VADOptions(),
                                         maxSpeechSeconds: Double? = nil) -> [SampleSpan]
where P.Element: BinaryFloatingPoint {
    let sr = Double(VoiceActivityRule.sampleRate)
    let window = VoiceActivityRule.chunkSamples
    let limit = options.maxSpeechSeconds ?? maxSpeechSeconds ?? .infinity
    let threshold = options.threshold
    let negThreshold = options.resolvedNegThreshold
    // Python: sampling_rate * ms / 1000 (an exact integer product, then one correctly rounded division)
    let minSpeechSamples = Double(VoiceActivityRule.sampleRate * options.minSpeechMs) / 1000
    let speechPadSamples = Double(VoiceActivityRule.sampleRate * options.speechPadMs) / 1000
    let maxSpeechSamples = sr * limit - Double(window) - 2 * speechPadSamples
    let minSilenceSamples = Double(VoiceActivityRule.sampleRate * options.minSilenceMs) / 1000
    let minSilenceAtMaxSpeech = Double(VoiceActivityRule.sampleRate * VoiceActivityRule.minSilenceAtMaxSpeechMs) / 1000

    var triggered = false
    var speeches: [SampleSpan] = []
    var current: Int?  // the open region's start (Python's current_speech['start'])
    var tempEnd = 0, prevEnd = 0, nextStart = 0  // 0: unset, as the package tests them
    var possibleEnds: [(end: Int, duration: Int)] = []

    for (i, value) in probabilities.enumerated() {
        let p = Double(value)
        let cur = window * i
        // speech again after a candidate end: record the silence when long enough
        if p >= threshold, tempEnd != 0 {
            let silence = cur - tempEnd
            if Double(silence) > minSilenceAtMaxSpeech { possibleEnds.append((tempEnd, silence)) }
            tempEnd = 0
            if nextStart < prevEnd { nextStart = cur }
        }
        if p >= threshold, !triggered {
            triggered = true
            current = cur
            continue
        }
        // the region reached its longest: cut at its longest silence (the first of equals), else here
        if triggered, let start = current, Double(cur - start) > maxSpeechSamples {
            if var best = possibleEnds.first {
                for e in possibleEnds.dropFirst() where e.duration > best.duration { best = e }
                prevEnd = best.end
                speeches.append(SampleSpan(start: start, end: prevEnd))
                current = nil
                nextStart = prevEnd + best.duration
                if nextStart < prevEnd + cur {
                    current = nextStart
                } else {
                    triggered = false
                }
                (prevEnd, nextStart, tempEnd) = (0, 0, 0)
                possibleEnds = []
            } else {
                // prevEnd is only set by the legacy cut (use_max_poss_sil_at_max_speech False): 0 here
                speeches.append(SampleSpan(start: start, end: cur))
                current = nil
                (prevEnd, nextStart, tempEnd) = (0, 0, 0)
                triggered = false
                possibleEnds = []
                continue
            }
        }
        // silence while in speech: the region ends after min_silence_ms of it
        if p < negThreshold, triggered {
            if tempEnd == 0 { tempEnd = cur }
            if Double(cur - tempEnd) < minSilenceSamples { continue }
            if let start = current, Double(tempEnd - start) > minSpeechSamples {
                speeches.append(SampleSpan(start: start, end: tempEnd))
            }
            current = nil
            (prevEnd, nextStart, tempEnd) = (0, 0, 0)
            triggered = false
            possibleEnds = []
            continue
        }
    }
    if let start = current, Double(sampleCount - start) > minSpeechSamples {
        speeches.append(SampleSpan(start: start, end: sampleCount))
    }

    // padding: speech_pad on each side, or half the gap where two regions are closer than two pads
    let n = Double(sampleCount)
    for i in speeches.indices {
        if i == 0 { speeches[i].start = Int(max(0, Double(speeches[i].start) - speechPadSamples)) }
        if i != speeches.count - 1 {
            let gap = speeches[i + 1].start - speeches[i].end
            if Double(gap) < 2 * speechPadSamples {
                let half = floorDivide(gap, 2)
                speeches[i].end += half
                speeches[i + 1].start = max(0, speeches[i + 1].start - half)
            } else {
                speeches[i].end = Int(min(n, Double(speeches[i].end) + speechPadSamples))
                speeches[i + 1].start = Int(max(0, Double(speeches[i + 1].start) - speechPadSamples))
            }
        } else {
            speeches[i].end = Int(min(n, Double(speeches[i].end) + speechPadSamples))
        }
    }
    return speeches
}

/// Python's `//` on integers (rounds towards minus infinity).
@inline(__always) func floorDivide(_ a: Int, _ b: Int) -> Int {
    let q = a / b
    return (a % b != 0 && (a < 0) != (b < 0)) ? q - 1 : q
}

/// Windows over the regions (Python's `pack_windows`), greedy in time order: a window starts at a region's
/// start; the next region joins it when the window would still hold at most `windowSamples` samples and the
/// pause before it is at most `maxGapSamples`; otherwise the window ends at the previous region's end.
/// Regions are never cut: one longer than the window, outside [0, sampleCount] or out of order is an error
/// (`speechRegions` with the longest region at most the window never gives one).
public func packWindows(_ regions: [SampleSpan], sampleCount: Int, windowSamples: Int,
                        maxGapSamples: Int) throws -> [SampleSpan] {
    var windows: [SampleSpan] = []
    var open: SampleSpan?  // the window so far: its start, its last region's end
    for r in regions {
        guard 0 <= r.start, r.start <= r.end, r.end <= sampleCount else {
            throw TranscriptionError.invalidArgument("speech region \(r) outside the audio [0, \(sampleCount))")
        }
        if let w = open, r.start < w.end {
            throw TranscriptionError.invalidArgument("speech regions overlap or are out of order at sample \(r.start)")
        }
        guard r.count <= windowSamples else {
            throw TranscriptionError.invalidArgument("speech region \(r) is longer than the \(windowSamples)-sample window")
        }
        if let w = open, r.end - w.start <= windowSamples, r.start - w.end <= maxGapSamples {
            open = SampleSpan(start: w.start, end: r.end)
            continue
        }
        if let w = open { windows.append(w) }
        open = r
    }
    if let w = open { windows.append(w) }
    return windows
}

/// Speech start and end events of a stream, one probability per 512-sample chunk: an exact port of
/// silero-vad's `VADIterator.__call__` (Python's `StreamVad`). Its negative threshold is threshold - 0.15 with
/// no floor, as the package has it. Samples are on the stream's timeline: a start is the chunk's start minus
/// the pad; an end is the first silent chunk's end plus the pad minus one chunk, after `minSilenceMs` of
/// probabilities below the negative threshold.
public struct StreamVAD: Sendable {
    public enum Event: Sendable, Equatable {
        case start(Int)
        case end(Int)
    }

    public let threshold: Double
    let minSilenceSamples: Double
    let speechPadSamples: Double
    public private(set) var triggered = false
    private var tempEnd = 0
    /// Samples of the chunks pushed so far.
    public private(set) var currentSample = 0

    public init(options: VADOptions = VADOptions()) {
        threshold = options.threshold
        minSilenceSamples = Double(VoiceActivityRule.sampleRate * options.minSilenceMs) / 1000
        speechPadSamples = Double(VoiceActivityRule.sampleRate * options.speechPadMs) / 1000
    }

    /// Back to the start of a stream.
    public mutating func reset() {
        (triggered, tempEnd, currentSample) = (false, 0, 0)
    }

    /// The next chunk's probability -> the event it causes, if any.
    public mutating func push<P: BinaryFloatingPoint>(_ probability: P) -> Event? {
        let p = Double(probability)
        let window = VoiceActivityRule.chunkSamples
        currentSample += window
        if p >= threshold, tempEnd != 0 { tempEnd = 0 }
        if p >= threshold, !triggered {
            triggered = true
            return .start(Int(max(0, Double(currentSample) - speechPadSamples - Double(window))))
        }
        if p < threshold - 0.15, triggered {
            if tempEnd == 0 { tempEnd = currentSample }
            if Double(currentSample - tempEnd) < minSilenceSamples { return nil }
            let end = Double(tempEnd) + speechPadSamples - Double(window)
            (tempEnd, triggered) = (0, false)
            return .end(Int(end))
        }
        return nil
    }
}
