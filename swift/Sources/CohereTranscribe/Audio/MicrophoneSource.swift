// The microphone as a stream source: compiled on Apple platforms only (macOS, iOS); Linux builds skip it.
// Its checks and start / stop bookkeeping are in MicrophoneChecks.swift (compiled and tested on Linux too).
#if os(macOS) || os(iOS)
import AVFoundation
import Foundation

/// Feeds the default input device into a stream's input (`CohereTranscriber.stream`): an `AVAudioEngine`
/// tap on `inputNode`, each buffer converted to 16 kHz mono Float32 by `AVAudioConverter` (`downmix = true`)
/// and yielded as one chunk.
///
///     let (input, updates) = try transcriber.stream(language: "en")
///     let mic = try MicrophoneSource(input: input)
///     try mic.start()
///     ...
///     mic.stop()   // finishes `input`: the open segment's final follows, then `updates` ends
///
/// The app declares `NSMicrophoneUsageDescription` in its Info.plist; a macOS app also needs the entitlement
/// of its signing: `com.apple.security.device.microphone` (App Sandbox) or `com.apple.security.device.audio-input`
/// (Hardened Runtime). On iOS the app sets the `AVAudioSession` category
/// (`.record`, `.playAndRecord` or `.multiRoute`) and requests the permission
/// (`AVAudioApplication.requestRecordPermission()`) before `start()`, which checks both, activates the
/// session and throws a `MicrophoneError` naming what is missing; on macOS a denied permission is refused
/// and an undetermined one is asked by the system. On both, an input format without sample rate or
/// channels is refused before the tap is installed. A second `start()` throws `.alreadyStarted` (one tap
/// per source), a `start()` after `stop()` throws `.stopped`; `stop()` may be called more than once.
///
/// `@unchecked Sendable`: `start` and `stop` run under `lock`; the tap block runs on the engine's audio
/// thread and touches only the converter, the target format and the continuation (itself Sendable), which
/// are set before the tap is installed.
public final class MicrophoneSource: @unchecked Sendable {
    private let engine = AVAudioEngine()
    private let target: AVAudioFormat
    private let input: AsyncStream<[Float]>.Continuation
    private var converter: AVAudioConverter?
    private let lock = NSLock()
    private var lifecycle = MicrophoneLifecycle()

    public init(input: AsyncStream<[Float]>.Continuation, sampleRate: Int = 16000) throws {
        guard let target = AVAudioFormat(commonFormat: .pcmFormatFloat32, sampleRate: Double(sampleRate), channels: 1,
                                         interleaved: false) else {
            throw AudioError.unsupported("cannot make a \(sampleRate) Hz mono float32 format")
        }
        self.target = target
        self.input = input
    }

    /// Checks the permission (and on iOS the audio session), installs the tap and starts the engine.
    public func start(bufferSize: AVAudioFrameCount = 4096) throws {
        lock.lock(); defer { lock.unlock() }
        try lifecycle.start()
        do {
            try checkAccess()
            let node = engine.inputNode
            let format = node.outputFormat(forBus: 0)
            try MicrophoneChecks.inputFormat(sampleRate: format.sampleRate, channels: format.channelCount)
            guard let converter = AVAudioConverter(from: format, to: target) else {
                throw AudioError.unsupported("cannot convert the microphone's \(format) to \(target)")
            }
            converter.downmix = true
            self.converter = converter
            node.installTap(onBus: 0, bufferSize: bufferSize, format: format) { [weak self] buffer, _ in
                self?.convert(buffer)
            }
            do {
                engine.prepare()
                try engine.start()
            } catch {
                node.removeTap(onBus: 0)
                throw error
            }
        } catch {
            lifecycle.startFailed()
            throw error
        }
    }

    /// Stops the engine and removes the tap (if started) and finishes the stream's input (once).
    public func stop() {
        lock.lock(); defer { lock.unlock() }
        let left = lifecycle.stop()
        if left == .running {
            engine.stop()
            engine.inputNode.removeTap(onBus: 0)
        }
        if left != .stopped { input.finish() }
    }

    /// The permission, and on iOS the session. AVAudioApplication.h (iOS 18.3 SDK): `@property (readonly)
    /// AVAudioApplicationRecordPermission recordPermission API_AVAILABLE(ios(17.0), watchos(10.0), tvos(17.0),
    /// macos(14.0))` (AVAudioSession's `recordPermission` is `API_DEPRECATED(..., ios(8.0, 17.0))`).
    private func checkAccess() throws {
        let permission: RecordPermission
        switch AVAudioApplication.shared.recordPermission {
        case .granted: permission = .granted
        case .denied: permission = .denied
        case .undetermined: permission = .undetermined
        @unknown default: permission = .undetermined
        }
        #if os(iOS)
        try MicrophoneChecks.permission(permission, mustBeGranted: true)
        // AVAudioSession.h: `@property (readonly) AVAudioSessionCategory category`, `@property (readonly,
        // getter=isInputAvailable) BOOL inputAvailable`, `- (BOOL)setActive:(BOOL)active error:(NSError **)outError`
        // (all `API_AVAILABLE(ios(...)) API_UNAVAILABLE(macos)`).
        let session = AVAudioSession.sharedInstance()
        let records: [AVAudioSession.Category] = [.record, .playAndRecord, .multiRoute]
        try MicrophoneChecks.session(category: session.category.rawValue, records: records.contains(session.category),
                                     inputAvailable: session.isInputAvailable)
        do {
            try session.setActive(true)
        } catch {
            throw MicrophoneError.sessionActivationFailed(error.localizedDescription)
        }
        #else
        try MicrophoneChecks.permission(permission, mustBeGranted: false)
        #endif
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
