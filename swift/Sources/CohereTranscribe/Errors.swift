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
