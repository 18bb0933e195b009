// The microphone as a stream source: compiled on Apple platforms only (macOS, iOS); Linux builds skip it.
#if os(macOS) || os(iOS)
import AVFoundation
import Foundation

/// Feeds the default input device into a stream's input (`CohereTranscriber.stream`): an `AVAudioEngine`
/// tap on `inputNode`, each buffer converted to 16 kHz mono Float32 by `AVAudioConverter` (`downmix = true`)
/// and yielded as one chunk. On iOS configure and activate the `AVAudioSession` (category `.record` or
/// `.playAndRecord`) and hold the microphone permission first.
///
///     let (input, updates) = try transcriber.stream(language: "en")
///     let mic = try MicrophoneSource(input: input)
///     try mic.start()
///     ...
///     mic.stop()   // finishes `input`: the open segment's final follows, then `updates` ends
///
/// `@unchecked Sendable`: `start` and `stop` run on the caller's thread; the tap block runs on the
/// engine's audio thread and touches only the converter, the target format and the continuation (itself
/// Sendable), which are set before the tap is installed.
public final class MicrophoneSource: @unchecked Sendable {
    private let engine = AVAudioEngine()
    private let target: AVAudioFormat
    private let input: AsyncStream<[Float]>.Continuation
    private var converter: AVAudioConverter?

    public init(input: AsyncStream<[Float]>.Continuation, sampleRate: Int = 16000) throws {
        guard let target = AVAudioFormat(commonFormat: .pcmFormatFloat32, sampleRate: Double(sampleRate), channels: 1,
                                         interleaved: false) else {
            throw AudioError.unsupported("cannot make a \(sampleRate) Hz mono float32 format")
        }
        self.target = target
        self.input = input
    }

    /// Installs the tap and starts the engine.
    public func start(bufferSize: AVAudioFrameCount = 4096) throws {
        let node = engine.inputNode
        let format = node.outputFormat(forBus: 0)
        guard let converter = AVAudioConverter(from: format, to: target) else {
            throw AudioError.unsupported("cannot convert the microphone's \(format) to \(target)")
        }
        converter.downmix = true
        self.converter = converter
        node.installTap(onBus: 0, bufferSize: bufferSize, format: format) { [weak self] buffer, _ in
            self?.convert(buffer)
        }
        engine.prepare()
        try engine.start()
    }

    /// Stops the engine, removes the tap and finishes the stream's input.
    public func stop() {
        engine.stop()
        engine.inputNode.removeTap(onBus: 0)
        input.finish()
    }

    private func convert(_ buffer: AVAudioPCMBuffer) {
        guard let converter else { return }
        let ratio = target.sampleRate / buffer.format.sampleRate
        let capacity = AVAudioFrameCount((Double(buffer.frameLength) * ratio).rounded(.up)) + 32
        guard let out = AVAudioPCMBuffer(pcmFormat: target, frameCapacity: capacity) else { return }
        let source = OneShotInput(buffer)
        var error: NSError?
        let status = converter.convert(to: out, error: &error) { _, inputStatus in
            if source.fed { inputStatus.pointee = .noDataNow; return nil }  // the converter keeps its state for the next buffer
            source.fed = true
            inputStatus.pointee = .haveData
            return source.buffer
        }
        guard status != .error, let data = out.floatChannelData, out.frameLength > 0 else { return }
        input.yield(Array(UnsafeBufferPointer(start: data[0], count: Int(out.frameLength))))
    }
}

/// One tap buffer handed to the converter once. A class, not a captured `var`: since the Xcode 26 SDKs
/// `AVAudioConverterInputBlock` is `NS_SWIFT_SENDABLE`, where mutating a captured variable does not
/// compile. `@unchecked Sendable`: `convert(to:error:withInputFrom:)` calls the block synchronously,
/// on the tap's thread, before it returns.
private final class OneShotInput: @unchecked Sendable {
    let buffer: AVAudioPCMBuffer
    var fed = false

    init(_ buffer: AVAudioPCMBuffer) { self.buffer = buffer }
}
#endif
