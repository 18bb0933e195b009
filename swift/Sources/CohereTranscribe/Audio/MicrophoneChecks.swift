// What `MicrophoneSource` (MicrophoneSource.swift, macOS / iOS only) decides before it touches the audio
// engine, apart from AVFoundation so that these decisions compile and are tested on Linux too.
import Foundation

/// The microphone permission as `AVAudioApplication.shared.recordPermission` reports it (AVAudioApplication.h:
/// `AVAudioApplicationRecordPermissionUndetermined`, `...Denied`, `...Granted`; iOS 17 / macOS 14).
enum RecordPermission: Sendable, Equatable {
    case undetermined, denied, granted
}

enum MicrophoneChecks {
    /// iOS needs the permission granted before the engine starts (the app asks with
    /// `AVAudioApplication.requestRecordPermission()`); macOS asks the user itself when the engine first
    /// reads the input, so there only a denial is refused.
    static func permission(_ permission: RecordPermission, mustBeGranted: Bool) throws {
        switch permission {
        case .granted: return
        case .denied: throw MicrophoneError.permissionDenied
        case .undetermined: if mustBeGranted { throw MicrophoneError.permissionUndetermined }
        }
    }

    /// iOS: the session's category (`category`: its raw value) must record, and input hardware must exist.
    static func session(category: String, records: Bool, inputAvailable: Bool) throws {
        guard records else { throw MicrophoneError.sessionCannotRecord(category: category) }
        guard inputAvailable else { throw MicrophoneError.noInputDevice }
    }

    /// The input node's output format on bus 0: a positive, finite sample rate and at least one channel.
    static func inputFormat(sampleRate: Double, channels: UInt32) throws {
        guard sampleRate.isFinite, sampleRate > 0, channels > 0 else {
            throw MicrophoneError.unusableInputFormat(sampleRate: sampleRate, channels: channels)
        }
    }
}

/// Started or not: a source installs at most one tap, and a stopped source (its stream input finished) does
/// not start again.
struct MicrophoneLifecycle: Sendable {
    enum Phase: Sendable, Equatable { case idle, running, stopped }
    private(set) var phase = Phase.idle

    /// Before the checks and the tap: refuses a second start and a start after `stop()`.
    mutating func start() throws {
        switch phase {
        case .idle: phase = .running
        case .running: throw MicrophoneError.alreadyStarted
        case .stopped: throw MicrophoneError.stopped
        }
    }

    /// A start that threw after `start()` (no tap left installed): idle again, so the app may retry.
    mutating func startFailed() {
        if phase == .running { phase = .idle }
    }

    /// Returns the phase `stop()` leaves: `.running` (stop the engine, remove the tap), `.idle` (nothing to
    /// stop) and both finish the input once; `.stopped` (a repeated stop) does nothing.
    mutating func stop() -> Phase {
        defer { phase = .stopped }
        return phase
    }
}
