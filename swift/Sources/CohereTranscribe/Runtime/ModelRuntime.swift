import Foundation

/// Where a component's predictions run (Core ML's `MLComputeUnits`; the interpreter ignores it).
public enum ComputeUnits: String, Sendable, CaseIterable {
    case all
    case cpuOnly = "cpu_only"
    case cpuAndGPU = "cpu_and_gpu"
    case cpuAndNeuralEngine = "cpu_and_ne"
}

/// Compute units per component. Default: front end on CPU/GPU, encoder and decoder on the Neural Engine.
public struct ComponentComputeUnits: Sendable {
    public var frontEnd: ComputeUnits
    public var encoder: ComputeUnits
    public var decoder: ComputeUnits

    public init(frontEnd: ComputeUnits = .cpuAndGPU, encoder: ComputeUnits = .cpuAndNeuralEngine,
                decoder: ComputeUnits = .cpuAndNeuralEngine) {
        self.frontEnd = frontEnd
        self.encoder = encoder
        self.decoder = decoder
    }

    /// The same units for every component.
    public static func uniform(_ units: ComputeUnits) -> ComponentComputeUnits {
        ComponentComputeUnits(frontEnd: units, encoder: units, decoder: units)
    }
}

/// A state of a stateful function (Core ML's `MLState`): one per sequence, never shared across threads.
public protocol RuntimeState: AnyObject {
    /// Writes `value` into the state buffer `name`, its first element at index `start` (one offset per axis):
    /// the host-state decoder's writes (the window's memory, each call's new K/V rows). Core ML: in place
    /// through `MLState.withMultiArray(for:)`, only the given region. Returns the bytes written.
    @discardableResult
    func write(_ name: String, _ value: Tensor, at start: [Int]) throws -> Int
}

/// One loaded function of a package. Predictions are async (Core ML's async prediction API): a
/// long prediction does not block a thread of the cooperative pool.
public protocol RuntimeModel: AnyObject, Sendable {
    var functionName: String { get }
    /// Inputs, outputs and states as the package declares them.
    var io: ModelIO { get }
    /// A fresh, zeroed state.
    func makeState() throws -> RuntimeState
    func predict(_ inputs: [String: Tensor], state: RuntimeState?) async throws -> [String: Tensor]
}

/// Loads package functions. `CoreMLRuntime` on macOS/iOS (and on Linux over the Core ML emulation),
/// `InterpreterRuntime` where `Process` exists (macOS, Linux) and Python runs.
public protocol ModelRuntime: AnyObject, Sendable {
    var name: String { get }
    func loadModel(at package: URL, functionName: String?, computeUnits: ComputeUnits) async throws -> RuntimeModel
}
