import Foundation
#if canImport(Darwin)
import Darwin
#elseif canImport(Glibc)
import Glibc
#endif

/// What a bench child does at its first prediction when $COHERE_BENCH_FAULT names its candidate: stand in for a
/// Neural Engine compile failure that passes load and kills the process at the first prediction (coremltools issue
/// 2758). `COHERE_BENCH_FAULT=<compute units | candidate id | *>:<sigkill | abort | exit | hang>[;...]`, e.g.
/// `cpu_and_ne:sigkill;cpu_and_gpu:exit` (exit: status 3). A test hook: nothing sets it but a test.
public struct FaultInjection: Sendable, Equatable {
    public enum Action: String, Sendable { case sigkill, abort, exit, hang }
    public var action: Action

    public static let environmentVariable = "COHERE_BENCH_FAULT"

    /// The fault $COHERE_BENCH_FAULT names for `candidate`, if any; a malformed value is an error naming it.
    public static func from(environment: [String: String], candidate: DeviceCandidate) throws -> FaultInjection? {
        guard let value = environment[environmentVariable], !value.isEmpty else { return nil }
        for entry in value.split(separator: ";") {  // the first entry naming the candidate
            guard let colon = entry.lastIndex(of: ":"),
                  let action = Action(rawValue: String(entry[entry.index(after: colon)...])) else {
                throw BenchmarkError("\(environmentVariable)='\(value)': expected entries "
                    + "<compute units|candidate id|*>:<sigkill|abort|exit|hang> separated by ';'")
            }
            let target = String(entry[..<colon])
            if target == "*" || target == candidate.computeUnits.rawValue || target == candidate.id {
                return FaultInjection(action: action)
            }
        }
        return nil
    }

    func fire() {
        switch action {
        case .sigkill: raise(SIGKILL)
        case .abort: abort()
        case .exit: exit(3)
        case .hang: while true { sleep(60) }
        }
    }
}

/// A runtime whose models fire a `FaultInjection` at their first prediction.
final class FaultInjectingRuntime: ModelRuntime, @unchecked Sendable {
    let base: ModelRuntime
    let fault: FaultInjection
    var name: String { base.name }

    init(base: ModelRuntime, fault: FaultInjection) {
        self.base = base
        self.fault = fault
    }

    func loadModel(at package: URL, functionName: String?, computeUnits: ComputeUnits) async throws -> RuntimeModel {
        FaultInjectingModel(base: try await base.loadModel(at: package, functionName: functionName, computeUnits: computeUnits),
                            fault: fault)
    }
}

final class FaultInjectingModel: RuntimeModel, @unchecked Sendable {
    let base: RuntimeModel
    let fault: FaultInjection
    var functionName: String { base.functionName }
    var io: ModelIO { base.io }

    init(base: RuntimeModel, fault: FaultInjection) {
        self.base = base
        self.fault = fault
    }

    func makeState() throws -> RuntimeState { try base.makeState() }

    func predict(_ inputs: [String: Tensor], state: RuntimeState?) async throws -> [String: Tensor] {
        fault.fire()
        return try await base.predict(inputs, state: state)
    }
}
