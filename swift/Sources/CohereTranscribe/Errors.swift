import Foundation

/// A bundle folder that is missing files, carries an unreadable or newer manifest, or whose packages
/// do not have the inputs/outputs/states the manifest describes.
public enum BundleError: Error, Equatable, CustomStringConvertible, LocalizedError {
    case missingFile(String)
    case unreadableManifest(String)
    case unsupportedFormat(String)
    case newerFormatVersion(found: Int, supported: Int)
    case ioMismatch(component: String, function: String, detail: String)
    case unknownLanguage(String, available: [String])
    case noFrontEnd(String)
    /// A path that leaves the bundle, or a symbolic link inside it.
    case unsafePath(String)
    /// A manifest field that is missing, of the wrong type, out of range or inconsistent with another
    /// (`field`: its dotted JSON path, as the Python loader names it).
    case invalidField(field: String, problem: String)

    public var description: String {
        switch self {
        case .missingFile(let s): return s
        case .unsafePath(let s): return s
        case .unreadableManifest(let s): return "unreadable manifest.json: \(s)"
        case .unsupportedFormat(let s): return s
        case .newerFormatVersion(let found, let supported):
            return "bundle format_version \(found) is newer than this package reads (\(supported)): update the Swift package"
        case .ioMismatch(let component, let function, let detail):
            return "\(component) package (function '\(function)') does not match the manifest: \(detail)"
        case .unknownLanguage(let language, let available):
            return "unsupported language '\(language)'; the bundle has prompts for: \(available.joined(separator: ", "))"
        case .noFrontEnd(let s): return s
        case .invalidField(let field, let problem): return "manifest.json: field '\(field)' \(problem)"
        }
    }
    public var errorDescription: String? { description }
}

/// Audio that cannot be read or turned into a window (names the file and the problem).
public enum AudioError: Error, Equatable, CustomStringConvertible, LocalizedError {
    case fileNotFound(String)
    case unreadable(String)
    case unsupported(String)
    case invalid(String)

    public var description: String {
        switch self {
        case .fileNotFound(let path): return "audio file not found: \(path)"
        case .unreadable(let s), .unsupported(let s), .invalid(let s): return s
        }
    }
    public var errorDescription: String? { description }
}

/// The runtime or the packages failed or produced something the loop cannot use.
public enum TranscriptionError: Error, Equatable, CustomStringConvertible, LocalizedError {
    case runtime(String)
    case invalidArray(String)
    case badOutput(String)
    case invalidArgument(String)

    public var description: String {
        switch self {
        case .runtime(let s): return "runtime: \(s)"
        case .invalidArray(let s): return "invalid array: \(s)"
        case .badOutput(let s): return s
        case .invalidArgument(let s): return s
        }
    }
    public var errorDescription: String? { description }
}

/// Why `MicrophoneSource.start()` refused to start (checked before the engine is touched: an input bus with
/// no sample rate or no channels makes `installTap` raise an Objective-C exception Swift cannot catch).
public enum MicrophoneError: Error, Equatable, CustomStringConvertible, LocalizedError {
    /// The user denied microphone access (`AVAudioApplication.shared.recordPermission == .denied`).
    case permissionDenied
    /// iOS: microphone access not requested yet (`.undetermined`).
    case permissionUndetermined
    /// iOS: the audio session's category does not record (`category`: its raw value).
    case sessionCannotRecord(category: String)
    /// iOS: `AVAudioSession.setActive(true)` failed.
    case sessionActivationFailed(String)
    /// iOS: no audio input hardware (`AVAudioSession.isInputAvailable` is false).
    case noInputDevice
    /// The input node's format has no sample rate or no channels.
    case unusableInputFormat(sampleRate: Double, channels: UInt32)
    /// `start()` while started: one tap per source.
    case alreadyStarted
    /// `start()` after `stop()`: the stream's input is finished.
    case stopped

    public var description: String {
        switch self {
        case .permissionDenied:
            return "microphone access is denied: the user can allow it in Settings > Privacy & Security > Microphone"
        case .permissionUndetermined:
            return "microphone access has not been requested: call AVAudioApplication.requestRecordPermission() before "
                + "start() (the app's Info.plist needs NSMicrophoneUsageDescription)"
        case .sessionCannotRecord(let category):
            return "the audio session's category \(category) does not record: set .record or .playAndRecord "
                + "(AVAudioSession.sharedInstance().setCategory) before start()"
        case .sessionActivationFailed(let why):
            return "cannot activate the audio session: \(why)"
        case .noInputDevice:
            return "no audio input is available"
        case .unusableInputFormat(let rate, let channels):
            return "the microphone input is \(rate) Hz with \(channels) channel(s): no usable input (no microphone, no "
                + "permission, or a macOS app without its entitlement: com.apple.security.device.microphone in the App "
                + "Sandbox, com.apple.security.device.audio-input with the Hardened Runtime)"
        case .alreadyStarted:
            return "the microphone source is already started"
        case .stopped:
            return "the microphone source was stopped and its stream input finished: make a new stream and source"
        }
    }
    public var errorDescription: String? { description }
}
