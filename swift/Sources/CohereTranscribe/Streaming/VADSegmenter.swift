import Foundation

/// What both segmenters offer the streaming session: frames in, open / close / cut events out.
protocol StreamSegmenter {
    /// Frames seen.
    var k: Int { get }
    /// The open segment's first sample.
    var start: Int? { get }
    var previousEnd: Int { get }
    /// How far before the current frame a segment may start (the audio the session keeps while none is open).
    var preroll: Int { get }
    mutating func push(_ power: Double, audio: (Int, Int) throws -> [Float]) throws -> SegmentEvent?
    mutating func finish(total: Int) -> SegmentEvent?
}

extension Segmenter: StreamSegmenter {}

/// Segments from the bundle's voice-activity model (Python's `VadSegmenter`, docs/streaming.md and docs/vad.md):
/// its speech probability per 512-sample chunk (`add(probabilities:)`) through the stream rule (`StreamVAD`:
/// silero-vad's VADIterator). A start event (decided at its chunk's end) opens a segment at its sample (never
/// before the previous segment's end); an end event closes it at its sample (at least two frames after the
/// segment's start: after a cut the rest may be that short). Each event acts at the first frame boundary at or
/// after the end of the chunk that decided it (chunks are longer than frames: at most one event a frame), so
/// the segments do not depend on how the audio is chunked. The maximum and the cut are the energy segmenter's;
/// after a cut the segment stays open (the model still hears speech). At the end of the audio an open segment
/// closes at the last sample (at a pending end event's sample; a start decided after the last whole frame is
/// not opened).
public struct VADSegmenter: Sendable {
    public let frame: Int
    public let maxSegment: Int
    public let context: Int
    public let minEnergyWindow: Int
    public let preroll: Int

    private var rule: StreamVAD
    /// (decided at sample, event) in order.
    private var events: [(decided: Int, event: StreamVAD.Event)] = []
    private var eventHead = 0
    private var chunks = 0
    public private(set) var k = 0
    public private(set) var start: Int?
    public private(set) var previousEnd = 0

    public var isOpen: Bool { start != nil }

    public init(options: VADOptions, frameSamples: Int, sampleRate: Int, maxSegment: Int, overlapSeconds: Double,
                minEnergyWindow: Int) throws {
        try options.validate()
        guard sampleRate == VoiceActivityRule.sampleRate else {
            throw TranscriptionError.invalidArgument(
                "the VAD runs at \(VoiceActivityRule.sampleRate) Hz; this bundle's audio is \(sampleRate) Hz")
        }
        frame = frameSamples
        self.maxSegment = maxSegment
        context = max(1, roundEven(overlapSeconds * Double(sampleRate)))
        self.minEnergyWindow = minEnergyWindow
        guard maxSegment >= 2 * frame else {
            throw TranscriptionError.invalidArgument("a segment of at most \(maxSegment) samples cannot hold two frames")
        }
        rule = StreamVAD(options: options)
        // the furthest back a start reaches from the frame it acts at: its chunk, the pad, one frame
        preroll = VoiceActivityRule.chunkSamples + Int(rule.speechPadSamples.rounded(.up)) + frame
    }

    /// The probabilities of the chunks the latest samples completed: the rule's events, queued.
    public mutating func add(probabilities: [Float]) {
        for p in probabilities {
            chunks += 1
            if let event = rule.push(p) { events.append((chunks * VoiceActivityRule.chunkSamples, event)) }
        }
    }

    /// One frame (its power is not used) -> the event it causes, if any.
    public mutating func push(_ power: Double, audio: (Int, Int) throws -> [Float]) throws -> SegmentEvent? {
        k += 1
        let frameEnd = k * frame
        if eventHead < events.count, events[eventHead].decided <= frameEnd {
            let event = events[eventHead].event
            eventHead += 1
            if eventHead > 1024 { events.removeFirst(eventHead); eventHead = 0 }
            switch event {
            case .start(let sample) where start == nil:
                let s = max(previousEnd, sample)
                start = s
                return SegmentEvent(kind: .open, frameEnd: frameEnd, start: s)
            case .end(let sample) where start != nil:
                return close(now: frameEnd, sample: sample)
            default: break
            }
        }
        if let s = start, frameEnd - s >= maxSegment {
            let cut = try Segmenter.cutPoint(start: s, maxSegment: maxSegment, context: context,
                                             minEnergyWindow: minEnergyWindow, frame: frame, audio: audio)
            (start, previousEnd) = (cut, cut)
            return SegmentEvent(kind: .cut, frameEnd: frameEnd, start: s, end: cut)
        }
        return nil
    }

    private mutating func close(now: Int, sample: Int) -> SegmentEvent {
        let s = start!
        let end = min(max(sample, s + 2 * frame), now)
        (start, previousEnd) = (nil, end)
        return SegmentEvent(kind: .close, frameEnd: now, start: s, end: end)
    }

    /// End of the audio: the open segment (if any) closes at `total`, or at a pending end event's sample.
    public mutating func finish(total: Int) -> SegmentEvent? {
        guard start != nil else { return nil }
        var pending: Int?
        for (_, event) in events[eventHead...] {
            if case .end(let sample) = event { pending = sample; break }
        }
        (events, eventHead) = ([], 0)
        return close(now: total, sample: pending ?? total)
    }
}

extension VADSegmenter: StreamSegmenter {}
