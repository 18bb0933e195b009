// EMULATION OF CORE ML'S COMPUTE-PLAN API (MLComputePlan, MLModelStructure, MLComputeDevice) FOR LINUX.
//
// The placement code (`ComputePlanWalker` in ComputePlacement.swift) is written against the iOS 18.3 SDK's
// CoreML.swiftmodule/arm64-apple-ios.swiftinterface and must compile there; this file gives it the same
// names, types, availability and Sendable conformances on Linux, where Core ML does not exist, so the same
// code type-checks and runs here. It declares only what the package uses, with the SDK's signatures (the
// enums with all their cases, as a `switch` over them sees them): the `MLModelAsset` overloads,
// `MLModelStructure.load`, `deviceUsage(for: Layer)`, `description` and `allComputeDevices` are left out.
// Declarations are internal (unlike CoreMLEmulation.swift's), so the package exports no compute-plan names
// on Linux. `MLModelConfiguration` comes from CoreMLEmulation.swift.
//
// Sendable, as the SDK declares it:
// - `MLComputePlan` is not: the interface has `@available(*, unavailable) extension CoreML.MLComputePlan :
//   Swift.Sendable {}`; its `DeviceUsage` and `Cost` are `Swift.Sendable` structs.
// - `MLModelStructure` and every nested type: `public enum MLModelStructure : Swift.Sendable` (and each
//   `public struct ... : Swift.Sendable`).
// - `MLComputeDevice`: `public enum MLComputeDevice : Swift.Equatable, Swift.Hashable,
//   Swift.CustomStringConvertible, Swift.Sendable`; its payloads are final and Sendable
//   (MLGPUComputeDevice.h, MLNeuralEngineComputeDevice.h: `ML_EXPORT NS_SWIFT_SENDABLE
//   __attribute__((objc_subclassing_restricted)) @interface ML...ComputeDevice : NSObject<MLComputeDeviceProtocol>`;
//   the CPU device likewise, as the Sendable enum that carries it requires).
//
// Behaviour: `MLComputePlan.load` throws `ComputePlanUnavailable` (placement is not available on Linux);
// no plan, structure or device is ever created here.
#if os(Linux)
import Foundation

/// Why the emulated `MLComputePlan.load` throws.
struct ComputePlanUnavailable: Error, CustomStringConvertible, LocalizedError {
    var description: String {
        "placement is not available on Linux: MLComputePlan (Core ML, macOS 14.4 / iOS 17.4) does not exist here; "
            + "run `cohere-transcribe-swift bench --runtime coreml` on a Mac or an iOS device"
    }
    var errorDescription: String? { description }
}

@available(macOS 14.0, iOS 17.0, watchOS 10.0, tvOS 17.0, *)
final class MLCPUComputeDevice: NSObject, Sendable {}

@available(macOS 14.0, iOS 17.0, watchOS 10.0, tvOS 17.0, *)
final class MLGPUComputeDevice: NSObject, Sendable {}

@available(macOS 14.0, iOS 17.0, watchOS 10.0, tvOS 17.0, *)
final class MLNeuralEngineComputeDevice: NSObject, Sendable {}

@available(macOS 14.0, iOS 17.0, watchOS 10.0, tvOS 17.0, *)
enum MLComputeDevice: Equatable, Hashable, Sendable {
    case cpu(MLCPUComputeDevice)
    case gpu(MLGPUComputeDevice)
    case neuralEngine(MLNeuralEngineComputeDevice)
}

@available(macOS 14.4, iOS 17.4, watchOS 10.4, tvOS 17.4, *)
enum MLModelStructure: Sendable {
    struct Program: Sendable {
        struct ValueType: Sendable {}
        struct Value: Sendable {}
        struct NamedValueType: Sendable {
            let name: String
            let type: MLModelStructure.Program.ValueType
        }
        enum Binding: Sendable {
            case value(MLModelStructure.Program.Value)
            case name(String)
        }
        struct Argument: Sendable {
            let bindings: [MLModelStructure.Program.Binding]
        }
        struct Function: Sendable {
            let inputs: [MLModelStructure.Program.NamedValueType]
            let block: MLModelStructure.Program.Block
        }
        struct Block: Sendable {
            let inputs: [MLModelStructure.Program.NamedValueType]
            let outputNames: [String]
            let operations: [MLModelStructure.Program.Operation]
        }
        struct Operation: Sendable {
            let operatorName: String
            let inputs: [String: MLModelStructure.Program.Argument]
            let outputs: [MLModelStructure.Program.NamedValueType]
            let blocks: [MLModelStructure.Program.Block]
        }
        let functions: [String: MLModelStructure.Program.Function]
    }

    struct NeuralNetwork: Sendable {
        struct Layer: Sendable {
            let name: String
            let type: String
            let inputNames: [String]
            let outputNames: [String]
        }
        let layers: [MLModelStructure.NeuralNetwork.Layer]
    }

    struct Pipeline: Sendable {
        let subModelNames: [String]
        let subModels: [MLModelStructure]
    }

    case neuralNetwork(MLModelStructure.NeuralNetwork)
    case program(MLModelStructure.Program)
    case pipeline(MLModelStructure.Pipeline)
    case unsupported
}

@available(macOS 14.4, iOS 17.4, watchOS 10.4, tvOS 17.4, *)
class MLComputePlan {
    struct DeviceUsage: Sendable {
        let supported: [MLComputeDevice]
        let preferred: MLComputeDevice
    }

    struct Cost: Sendable {
        let weight: Double
    }

    final let modelStructure: MLModelStructure

    private init(modelStructure: MLModelStructure) {
        self.modelStructure = modelStructure
    }

    /// The SDK's `public static func load(contentsOf url: Foundation.URL, configuration:
    /// CoreML.MLModelConfiguration) async throws -> CoreML.MLComputePlan` (MLComputePlan.h:
    /// `+loadContentsOfURL:configuration:completionHandler:`): no function parameter; the configuration's
    /// `functionName` (macOS 15 / iOS 18) picks the function of a multifunction package. Always throws on
    /// Linux: there is no Core ML to ask.
    static func load(contentsOf url: URL, configuration: MLModelConfiguration) async throws -> MLComputePlan {
        throw ComputePlanUnavailable()
    }

    func estimatedCost(of operation: MLModelStructure.Program.Operation) -> MLComputePlan.Cost? { nil }

    func deviceUsage(for operation: MLModelStructure.Program.Operation) -> MLComputePlan.DeviceUsage? { nil }
}

@available(*, unavailable)
extension MLComputePlan: Sendable {}
#endif
