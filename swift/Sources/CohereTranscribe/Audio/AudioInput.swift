import Foundation
#if os(macOS) || os(iOS)
import AVFoundation
#endif

/// Mono Float audio at the model's sample rate.
public struct AudioSamples: Sendable {
    public var samples: [Float]
    public var sampleRate: Int
}

public enum AudioInput {
    /// Reads `url` as mono Float at `sampleRate`.
    ///
    /// WAV files (PCM 8/16/24/32-bit, float32/64) go through `WAVReader` on every platform, channels
    /// averaged; at the target rate they give exactly the samples Python's `load_audio` gives. Other
    /// rates are resampled with `Resampler` (windowed sinc), which is close to but not bit-equal to
    /// Python's soxr: transcripts of resampled audio can differ from Python's in rare near-ties.
    /// On macOS and iOS every other format AVFoundation reads (m4a, mp3, flac, caf, mu-law or ADPCM WAV,
    /// ...) is decoded by AVFoundation, its channels averaged (as Python does), then converted to the
    /// target rate by AVAudioConverter.
    public static func load(contentsOf url: URL, sampleRate: Int = 16000) throws -> AudioSamples {
        guard FileManager.default.fileExists(atPath: url.path) else {
            throw AudioError.fileNotFound(url.path)
        }
        if WAVReader.isWAV(url) {
            do {
                let wav = try WAVReader.read(url)
                let mono = wav.sampleRate == sampleRate
                    ? wav.mono : Resampler.resample(wav.mono, from: wav.sampleRate, to: sampleRate)
                return AudioSamples(samples: mono, sampleRate: sampleRate)
            } catch AudioError.unsupported(let why) {
                // a WAV encoding WAVReader does not decode (mu-law, ADPCM, ...): AVFoundation does
                #if os(macOS) || os(iOS)
                return try readWithAVFoundation(url, sampleRate: sampleRate)
                #else
                throw AudioError.unsupported(why)
                #endif
            }
        }
        #if os(macOS) || os(iOS)
        return try readWithAVFoundation(url, sampleRate: sampleRate)
        #else
        throw AudioError.unsupported(
            "\(url.path): only WAV files can be read on this platform (AVFoundation is not available); convert it to WAV")
        #endif
    }

    #if os(macOS) || os(iOS)
    static func readWithAVFoundation(_ url: URL, sampleRate: Int) throws -> AudioSamples {
        let file: AVAudioFile
        do {
            file = try AVAudioFile(forReading: url)
        } catch {
            throw AudioError.unreadable("cannot decode audio file \(url.path): \(error.localizedDescription)")
        }
        let source = file.processingFormat  // deinterleaved Float32, the file's channels and rate
        guard let input = AVAudioPCMBuffer(pcmFormat: source, frameCapacity: AVAudioFrameCount(file.length)) else {
            throw AudioError.unsupported("\(url.path): cannot allocate a buffer for \(source)")
        }
        do { try file.read(into: input) } catch {
            throw AudioError.unreadable("cannot read audio file \(url.path): \(error.localizedDescription)")
        }
        guard let channels = input.floatChannelData else {
            throw AudioError.unsupported("\(url.path): AVFoundation gave no float samples for \(source)")
        }
        // channels averaged here, as Python's load_audio and WAVReader do (AVAudioConverter would remap)
        let count = Int(input.frameLength), channelCount = Int(source.channelCount)
        var mono = [Float](repeating: 0, count: count)
        for c in 0..<channelCount {
            let data = channels[c]
            for i in 0..<count { mono[i] += data[i] }
        }
        if channelCount > 1 { for i in 0..<count { mono[i] /= Float(channelCount) } }
        if Int(source.sampleRate) == sampleRate && Double(sampleRate) == source.sampleRate {
            return AudioSamples(samples: mono, sampleRate: sampleRate)
        }
        guard let monoFormat = AVAudioFormat(commonFormat: .pcmFormatFloat32, sampleRate: source.sampleRate,
                                             channels: 1, interleaved: false),
              let target = AVAudioFormat(commonFormat: .pcmFormatFloat32, sampleRate: Double(sampleRate),
                                         channels: 1, interleaved: false),
              let converter = AVAudioConverter(from: monoFormat, to: target),
              let monoBuffer = AVAudioPCMBuffer(pcmFormat: monoFormat, frameCapacity: AVAudioFrameCount(max(count, 1))) else {
            throw AudioError.unsupported("\(url.path): cannot convert \(source) to \(sampleRate) Hz mono")
        }
        converter.downmix = true  // mono to mono: no channel remapping either way
        monoBuffer.frameLength = AVAudioFrameCount(count)
        mono.withUnsafeBufferPointer { monoBuffer.floatChannelData![0].update(from: $0.baseAddress!, count: count) }
        let capacity = AVAudioFrameCount(Double(count) * Double(sampleRate) / source.sampleRate) + 1024
        guard let output = AVAudioPCMBuffer(pcmFormat: target, frameCapacity: capacity) else {
            throw AudioError.unsupported("\(url.path): cannot allocate the conversion buffer")
        }
        var delivered = false
        var conversionError: NSError?
        converter.convert(to: output, error: &conversionError) { _, status in
            if delivered { status.pointee = .endOfStream; return nil }
            delivered = true
            status.pointee = .haveData
            return monoBuffer
        }
        if let conversionError {
            throw AudioError.unreadable("cannot convert \(url.path): \(conversionError.localizedDescription)")
        }
        let samples = Array(UnsafeBufferPointer(start: output.floatChannelData![0], count: Int(output.frameLength)))
        return AudioSamples(samples: samples, sampleRate: sampleRate)
    }
    #endif

    /// Below this peak amplitude audio is digital silence (Python's `config.SILENCE_PEAK`).
    public static let silencePeak: Float = 1e-4

    /// Whether `samples` hold anything to transcribe, decided as Python's `longform.check_audio`: empty or
    /// NaN/inf audio is an error; a peak below `silencePeak` is digital silence (an empty transcript marked
    /// silent, no model call); anything else is speech.
    public static func isSilent(_ samples: [Float], name: String) throws -> Bool {
        guard !samples.isEmpty else { throw AudioError.invalid("\(name) is empty (0 samples)") }
        var peak: Float = 0
        var bad = 0
        for x in samples {
            if !x.isFinite { bad += 1 } else { peak = max(peak, abs(x)) }
        }
        if bad > 0 { throw AudioError.invalid("\(name) holds \(bad) NaN/inf sample(s) of \(samples.count)") }
        return peak < silencePeak
    }
}

/// RIFF/WAVE reader: PCM 8 (unsigned), 16, 24, 32-bit and IEEE float 32/64, any channel count, also
/// WAVE_FORMAT_EXTENSIBLE. Integers are scaled as libsndfile scales them (x / 2^(bits-1); 8-bit: (x-128)/128),
/// channels are averaged.
public enum WAVReader {
    public struct WAV {
        public var sampleRate: Int
        public var channels: Int
        public var bitsPerSample: Int
        public var isFloat: Bool
        public var mono: [Float]
    }

    static func isWAV(_ url: URL) -> Bool {
        guard let handle = try? FileHandle(forReadingFrom: url) else { return false }
        defer { try? handle.close() }
        let head = (try? handle.read(upToCount: 12)) ?? Data()
        return head.count == 12 && head.prefix(4) == Data("RIFF".utf8) && head.subdata(in: 8..<12) == Data("WAVE".utf8)
    }

    public static func read(_ url: URL) throws -> WAV {
        guard FileManager.default.fileExists(atPath: url.path) else { throw AudioError.fileNotFound(url.path) }
        let data: Data
        do { data = try Data(contentsOf: url) } catch {
            throw AudioError.unreadable("cannot read \(url.path): \(error.localizedDescription)")
        }
        return try parse(data, name: url.path)
    }

    public static func parse(_ data: Data, name: String) throws -> WAV {
        let bytes = [UInt8](data)
        func u16(_ o: Int) -> Int { Int(bytes[o]) | Int(bytes[o + 1]) << 8 }
        func u32(_ o: Int) -> Int { u16(o) | u16(o + 2) << 16 }
        guard bytes.count >= 12, bytes[0..<4] == [0x52, 0x49, 0x46, 0x46], bytes[8..<12] == [0x57, 0x41, 0x56, 0x45] else {
            throw AudioError.unsupported("\(name): not a RIFF/WAVE file")
        }
        var format = -1, channels = 0, rate = 0, bits = 0, blockAlign = 0
        var dataRange: Range<Int>?
        var offset = 12
        while offset + 8 <= bytes.count {
            let id = String(decoding: bytes[offset..<offset + 4], as: UTF8.self)
            let size = u32(offset + 4)
            let body = offset + 8
            if id == "fmt " {
                guard size >= 16, body + 16 <= bytes.count else { throw AudioError.invalid("\(name): truncated fmt chunk") }
                format = u16(body)
                channels = u16(body + 2)
                rate = u32(body + 4)
                blockAlign = u16(body + 12)
                bits = u16(body + 14)
                if format == 0xFFFE {  // WAVE_FORMAT_EXTENSIBLE: the sub-format GUID starts with the format tag
                    guard size >= 40, body + 26 <= bytes.count else {
                        throw AudioError.invalid("\(name): truncated WAVE_FORMAT_EXTENSIBLE header")
                    }
                    format = u16(body + 24)
                }
            } else if id == "data" {
                dataRange = body..<min(body + size, bytes.count)  // tolerate a size field past the end (streamed files)
                break
            }
            offset = body + size + (size & 1)
        }
        guard format >= 0 else { throw AudioError.invalid("\(name): WAV file without a fmt chunk") }
        guard let range = dataRange else { throw AudioError.invalid("\(name): WAV file without a data chunk") }
        let isFloat = format == 3
        guard format == 1 || isFloat else {
            throw AudioError.unsupported(
                "\(name): WAV format tag 0x\(String(format: "%04X", format)) is not supported (PCM or IEEE float only); convert it to 16-bit PCM")
        }
        guard (!isFloat && [8, 16, 24, 32].contains(bits)) || (isFloat && [32, 64].contains(bits)) else {
            throw AudioError.unsupported("\(name): \(bits)-bit \(isFloat ? "float" : "PCM") WAV is not supported")
        }
        guard channels >= 1, rate > 0, blockAlign == channels * bits / 8 else {
            throw AudioError.invalid("\(name): inconsistent WAV header (\(channels) channels, \(rate) Hz, block \(blockAlign))")
        }
        let frames = range.count / blockAlign
        let width = bits / 8
        var mono = [Float](repeating: 0, count: frames)
        let base = range.lowerBound
        for f in 0..<frames {
            var sum: Float = 0
            for c in 0..<channels {
                let o = base + f * blockAlign + c * width
                let v: Float
                switch (isFloat, bits) {
                case (false, 8): v = (Float(bytes[o]) - 128) / 128
                case (false, 16): v = Float(Int16(bitPattern: UInt16(u16(o)))) / 32768
                case (false, 24):
                    let raw = Int32(bitPattern: UInt32(bytes[o]) << 8 | UInt32(bytes[o + 1]) << 16 | UInt32(bytes[o + 2]) << 24)
                    v = Float(raw >> 8) / 8_388_608
                case (false, _): v = Float(Double(Int32(bitPattern: UInt32(u32(o)))) / 2_147_483_648)
                case (true, 32): v = Float(bitPattern: UInt32(u32(o)))
                default:
                    let lo = UInt64(u32(o)), hi = UInt64(u32(o + 4))
                    v = Float(Double(bitPattern: lo | hi << 32))
                }
                sum += v
            }
            mono[f] = channels == 1 ? sum : sum / Float(channels)
        }
        return WAV(sampleRate: rate, channels: channels, bitsPerSample: bits, isFloat: isFloat, mono: mono)
    }
}

/// Band-limited resampling (Hann-windowed sinc, 32 zero crossings, cutoff at 0.95 x the lower Nyquist).
/// Not bit-equal to Python's soxr: token identity with Python is only guaranteed for 16 kHz input.
public enum Resampler {
    public static func resample(_ x: [Float], from source: Int, to target: Int) -> [Float] {
        guard source != target, !x.isEmpty else { return x }
        let ratio = Double(target) / Double(source)
        let cutoff = 0.95 * min(1.0, ratio)  // relative to the source Nyquist
        let zeros = 32.0
        let halfWidth = zeros / cutoff  // in source samples
        let count = Int((Double(x.count) * ratio).rounded())
        var out = [Float](repeating: 0, count: count)
        for i in 0..<count {
            let t = Double(i) / ratio
            let lo = max(0, Int((t - halfWidth).rounded(.up)))
            let hi = min(x.count - 1, Int((t + halfWidth).rounded(.down)))
            var acc = 0.0
            if lo <= hi {
                for j in lo...hi {
                    let d = Double(j) - t
                    let arg = d * cutoff
                    let sinc = arg == 0 ? 1.0 : sin(Double.pi * arg) / (Double.pi * arg)
                    let window = 0.5 + 0.5 * cos(Double.pi * d / halfWidth)
                    acc += Double(x[j]) * cutoff * sinc * window
                }
            }
            out[i] = Float(acc)
        }
        return out
    }
}

/// Long-audio splitting with Python's `split_points` boundaries (`CohereAsrFeatureExtractor`'s):
/// clips up to `max_audio_clip_s - overlap_chunk_second` stay whole; longer ones are cut into pieces of
/// at most `max_audio_clip_s`, each at the start of the quietest `min_energy_window_samples` window (RMS,
/// non-overlapping steps) in the last `overlap_chunk_second` before the limit. Energies are summed in
/// Double (Python: torch float32); only an exact near-tie between two windows could pick differently.
public enum AudioSplitter {
    public static func splitPoints(sampleCount total: Int, samples x: [Float], sampleRate: Int, maxClipSeconds: Double,
                                   overlapSeconds: Double, minEnergyWindow: Int) -> [Range<Int>] {
        if Double(total) / Double(sampleRate) <= max(0, maxClipSeconds - overlapSeconds) { return [0..<total] }
        let chunk = max(1, Int((maxClipSeconds * Double(sampleRate)).rounded(.toNearestOrEven)))
        let context = max(1, Int((overlapSeconds * Double(sampleRate)).rounded(.toNearestOrEven)))
        if total <= chunk { return [0..<total] }
        var ranges: [Range<Int>] = []
        var idx = 0
        while idx < total {
            if idx + chunk >= total {
                ranges.append(idx..<total)
                break
            }
            let searchStart = max(idx, idx + chunk - context)
            let searchEnd = min(idx + chunk, total)
            var split = searchEnd <= searchStart
                ? idx + chunk : quietest(x, start: searchStart, end: searchEnd, window: minEnergyWindow)
            split = max(idx + 1, min(split, total))
            ranges.append(idx..<split)
            idx = split
        }
        return ranges.filter { !$0.isEmpty }
    }

    public static func splitPoints(_ x: [Float], manifest: BundleManifest) -> [Range<Int>] {
        let a = manifest.audio
        return splitPoints(sampleCount: x.count, samples: x, sampleRate: a.samplingRate, maxClipSeconds: a.maxAudioClipSeconds,
                           overlapSeconds: a.overlapChunkSeconds, minEnergyWindow: a.minEnergyWindowSamples)
    }

    static func quietest(_ x: [Float], start: Int, end: Int, window: Int) -> Int {
        let length = end - start
        if length <= window { return (start + end) / 2 }
        var best = Double.infinity
        var bestIndex = start
        var i = 0
        while i < length - window {
            var sum = 0.0
            for j in start + i..<start + i + window {
                sum += Double(x[j]) * Double(x[j])
            }
            let energy = (sum / Double(window)).squareRoot()
            if energy < best {
                best = energy
                bestIndex = start + i
            }
            i += window
        }
        return bestIndex
    }
}
