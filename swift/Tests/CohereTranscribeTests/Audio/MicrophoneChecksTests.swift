@testable import CohereTranscribe
import XCTest

/// `MicrophoneSource`'s decisions (MicrophoneChecks.swift): the source itself needs AVFoundation and a
/// microphone, these run everywhere.
final class MicrophoneChecksTests: XCTestCase {
    func testInputFormatsWithoutRateOrChannelsAreRefused() throws {
        for (rate, channels) in [(0.0, UInt32(0)), (48000, 0), (0, 1), (-16000, 1), (.nan, 1), (.infinity, 2)] {
            XCTAssertThrowsError(try MicrophoneChecks.inputFormat(sampleRate: rate, channels: channels), "\(rate) \(channels)") {
                guard case .unusableInputFormat(let r, let c) = $0 as? MicrophoneError else {
                    return XCTFail("\($0)")
                }
                XCTAssertEqual(c, channels)
                XCTAssertTrue(r == rate || (r.isNaN && rate.isNaN))
                for entitlement in ["com.apple.security.device.microphone", "com.apple.security.device.audio-input"] {
                    XCTAssertTrue("\($0)".contains(entitlement), "\($0)")
                }
            }
        }
        try MicrophoneChecks.inputFormat(sampleRate: 48000, channels: 1)
        try MicrophoneChecks.inputFormat(sampleRate: 44100, channels: 2)
    }

    func testPermissionIsRequiredOnIOSAndOnlyADenialIsRefusedOnMacOS() throws {
        for mustBeGranted in [true, false] {
            try MicrophoneChecks.permission(.granted, mustBeGranted: mustBeGranted)
            XCTAssertThrowsError(try MicrophoneChecks.permission(.denied, mustBeGranted: mustBeGranted)) {
                XCTAssertEqual($0 as? MicrophoneError, .permissionDenied)
            }
        }
        XCTAssertThrowsError(try MicrophoneChecks.permission(.undetermined, mustBeGranted: true)) {
            XCTAssertEqual($0 as? MicrophoneError, .permissionUndetermined)
            XCTAssertTrue("\($0)".contains("NSMicrophoneUsageDescription"), "\($0)")
        }
        try MicrophoneChecks.permission(.undetermined, mustBeGranted: false)  // macOS asks when the engine starts
    }

    func testSessionMustRecordAndHaveInput() throws {
        XCTAssertThrowsError(try MicrophoneChecks.session(category: "AVAudioSessionCategorySoloAmbient", records: false,
                                                          inputAvailable: true)) {
            XCTAssertEqual($0 as? MicrophoneError, .sessionCannotRecord(category: "AVAudioSessionCategorySoloAmbient"))
            XCTAssertTrue("\($0)".contains("AVAudioSessionCategorySoloAmbient"), "\($0)")
        }
        XCTAssertThrowsError(try MicrophoneChecks.session(category: "record", records: true, inputAvailable: false)) {
            XCTAssertEqual($0 as? MicrophoneError, .noInputDevice)
        }
        try MicrophoneChecks.session(category: "record", records: true, inputAvailable: true)
    }

    /// One tap per source: a second start is refused while running, a failed start can be retried, a
    /// stopped source does not start again, and only the first stop finishes the input.
    func testLifecycleStartsOnceAndStopsOnce() throws {
        var life = MicrophoneLifecycle()
        XCTAssertEqual(life.phase, .idle)
        try life.start()
        XCTAssertEqual(life.phase, .running)
        XCTAssertThrowsError(try life.start()) { XCTAssertEqual($0 as? MicrophoneError, .alreadyStarted) }
        XCTAssertEqual(life.phase, .running)
        XCTAssertEqual(life.stop(), .running)  // engine stopped, tap removed, input finished
        XCTAssertEqual(life.stop(), .stopped)  // a repeated stop does nothing
        XCTAssertThrowsError(try life.start()) { XCTAssertEqual($0 as? MicrophoneError, .stopped) }
        XCTAssertEqual(life.phase, .stopped)

        var failing = MicrophoneLifecycle()
        try failing.start()
        failing.startFailed()  // e.g. the permission check threw: no tap was left installed
        XCTAssertEqual(failing.phase, .idle)
        try failing.start()
        XCTAssertEqual(failing.phase, .running)

        var unused = MicrophoneLifecycle()
        XCTAssertEqual(unused.stop(), .idle)  // nothing to stop; the input is finished
        unused.startFailed()
        XCTAssertEqual(unused.phase, .stopped)
    }
}
