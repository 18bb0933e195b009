import Foundation
#if os(macOS) || os(iOS)
import CoreML
#endif

/// Where Core ML places one package function's operations (`MLComputePlan`, macOS 14.4 / iOS 17.4): per
/// preferred device the operation count and the summed estimated cost, and every operation that does not
/// run on the Neural Engine. Operations without a device usage (constants) count under "none" and carry
/// no cost.
public struct FunctionPlacement: Encodable, Sendable {
    public struct Operation: Encodable, Sendable {
        public var operatorName: String
        public var outputs: [String]
        public var cost: Double?
        public var device: String
        public var supported: [String]

        enum CodingKeys: String, CodingKey {
            case operatorName = "operator", outputs, cost, device, supported
        }
    }

    public var package: String
    public var function: String
    public var computeUnits: String
    /// Operations walked, nested blocks included.
    public var operations: Int = 0
    /// "neural_engine", "gpu", "cpu" (preferred device), "none" (no device usage: constants).
    public var operationsByDevice: [String: Int] = [:]
    /// Per operator (e.g. "ios18.matmul"): operations per preferred device ("none" as above).
    public var operationsByType: [String: [String: Int]] = [:]
    /// Sum of `estimatedCost(of:).weight` per preferred device.
    public var costByDevice: [String: Double] = [:]
    /// `costByDevice` over the total cost of the function's operations.
    public var costShare: [String: Double] = [:]
    public var notOnNeuralEngine: [Operation] = []
    /// Why this function has no placement (the plan could not be loaded, or has no such function).
    public var error: String?

    enum CodingKeys: String, CodingKey {
        case package, function, computeUnits = "compute_units", operations = "ops",
             operationsByDevice = "ops_by_device", operationsByType = "ops_by_type", costByDevice = "cost_by_device", costShare = "cost_share",
             notOnNeuralEngine = "not_on_neural_engine", error
    }
}

/// A package of the bundle and the functions of it the transcriber uses, with their compute units.
struct PlacementTarget {
    var package: URL
    var functions: [String]
    var units: ComputeUnits
}

#if os(macOS) || os(iOS) || os(Linux)
/// Walks `MLComputePlan.modelStructure` (on Linux: the emulation in CoreMLEmulation+ComputePlan.swift,
/// whose `load` throws). Written against the SDK's declarations.
@available(macOS 14.4, iOS 17.4, *)
enum ComputePlanWalker {
    /// Placement of `target.functions` from the compiled model at `compiled`: one plan per function, loaded with
    /// `MLModelConfiguration.functionName` set to it (macOS 15 / iOS 18; "main" as the transcriber loads it: nil, the
    /// package's default function), so each function's placement is the one Core ML plans for that function. Throws
    /// when no function's plan can be loaded (on Linux, always); a function whose plan fails or which the plan lacks
    /// is reported in its row.
    ///
    /// The SDK has no function parameter on the load (iOS 18.3 CoreML.swiftinterface: `public static func
    /// load(contentsOf url: Foundation.URL, configuration: CoreML.MLModelConfiguration) async throws ->
    /// CoreML.MLComputePlan`); the configuration picks the function (MLModelConfiguration.h: `@property (readwrite,
    /// nullable, copy, nonatomic) NSString *functionName API_AVAILABLE(macos(15.0), ios(18.0), ...)`).
    static func placement(compiled: URL, target: PlacementTarget) async throws -> [FunctionPlacement] {
        let package = target.package.lastPathComponent
        var rows: [FunctionPlacement] = []
        var lastError: Error?
        for name in target.functions {
            var row = FunctionPlacement(package: package, function: name, computeUnits: target.units.rawValue)
            let configuration = MLModelConfiguration()
            configuration.computeUnits = target.units.coreML
            configuration.functionName = name == "main" ? nil : name
            let plan: MLComputePlan
            do {
                plan = try await MLComputePlan.load(contentsOf: compiled, configuration: configuration)
            } catch {
                lastError = error
                row.error = "MLComputePlan.load (functionName \(configuration.functionName ?? "nil")) failed: "
                    + error.localizedDescription
                rows.append(row)
                continue
            }
            switch plan.modelStructure {
            case .program(let program):
                if let function = program.functions[name] {
                    walk(function.block, plan: plan, into: &row)
                    let total = row.costByDevice.values.reduce(0, +)
                    if total > 0 { row.costShare = row.costByDevice.mapValues { $0 / total } }
                } else {
                    row.error = "the compute plan has no function '\(name)' (it has: "
                        + program.functions.keys.sorted().joined(separator: ", ") + ")"
                }
            case .neuralNetwork, .pipeline, .unsupported:
                row.error = "the compiled model is not an ML program"
            @unknown default:
                row.error = "the compiled model is not an ML program"
            }
            rows.append(row)
        }
        if let lastError, rows.allSatisfy({ $0.error != nil }) { throw lastError }
        return rows
    }

    static func walk(_ block: MLModelStructure.Program.Block, plan: MLComputePlan, into row: inout FunctionPlacement) {
        for operation in block.operations {
            row.operations += 1
            let cost = plan.estimatedCost(of: operation)?.weight
            if let usage = plan.deviceUsage(for: operation) {
                let device = name(usage.preferred)
                row.operationsByDevice[device, default: 0] += 1
                row.operationsByType[operation.operatorName, default: [:]][device, default: 0] += 1
                row.costByDevice[device, default: 0] += cost ?? 0
                if device != "neural_engine" {
                    row.notOnNeuralEngine.append(FunctionPlacement.Operation(
                        operatorName: operation.operatorName, outputs: operation.outputs.map(\.name), cost: cost,
                        device: device, supported: usage.supported.map(name)))
                }
            } else {
                row.operationsByDevice["none", default: 0] += 1
                row.operationsByType[operation.operatorName, default: [:]]["none", default: 0] += 1
            }
            for nested in operation.blocks { walk(nested, plan: plan, into: &row) }
        }
    }

    static func name(_ device: MLComputeDevice) -> String {
        switch device {
        case .neuralEngine: return "neural_engine"
        case .gpu: return "gpu"
        case .cpu: return "cpu"
        @unknown default: return "other"
        }
    }
}
#endif
