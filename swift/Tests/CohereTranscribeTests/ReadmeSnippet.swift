// The README's Swift snippet ("Use it from an app"), verbatim: compiled with the tests, so the README
// cannot show an API the package does not have. It is compiled, not run: it needs a bundle at "q8"
// and, off macOS and iOS, a runtime passed explicitly. The imports are exactly the snippet's, with no
// `@testable`, so it sees only the package's public API. tests/test_readme.py checks that this file
// holds the README's block line for line.
import CohereTranscribe
import Foundation

// README snippet: begin
func readmeSnippet() async throws {
    let transcriber = try await CohereTranscriber(bundle: URL(fileURLWithPath: "q8"))
    let clip = URL(fileURLWithPath: "clip.wav")
    print(try await transcriber.transcribe(contentsOf: clip, language: "en").text)
    let (input, updates) = try transcriber.stream(language: "en")  // live: 16 kHz mono [Float] chunks
    Task { try await StreamFileSource.feed(contentsOf: clip, sampleRate: 16_000, into: input) }
    for try await update in updates { print(update.type, update.text) }  // partial, then final
}
// README snippet: end
