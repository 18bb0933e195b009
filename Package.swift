// swift-tools-version:6.0
// The app-side Swift package: an app adds this repository as a package dependency (see docs/swift.md).
// Sources and tests live under swift/ (a root `Tests/` folder would be the same folder as `tests/` on
// macOS's case-insensitive file system).
import PackageDescription

let package = Package(
    name: "CohereTranscribe",
    platforms: [.macOS(.v15), .iOS(.v18)],
    products: [
        .library(name: "CohereTranscribe", targets: ["CohereTranscribe"]),
        .executable(name: "cohere-transcribe-swift", targets: ["CohereTranscribeCLI"]),
    ],
    targets: [
        .target(name: "CohereTranscribe", path: "swift/Sources/CohereTranscribe"),
        .executableTarget(name: "CohereTranscribeCLI", dependencies: ["CohereTranscribe"],
                          path: "swift/Sources/CohereTranscribeCLI"),
        .testTarget(name: "CohereTranscribeTests", dependencies: ["CohereTranscribe"],
                    path: "swift/Tests/CohereTranscribeTests"),
    ],
    swiftLanguageModes: [.v5]
)
