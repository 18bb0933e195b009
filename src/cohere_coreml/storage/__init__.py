"""Storage: how every stage puts files on disk, so that nothing appears half-written.

Takes: bytes, JSON, converted packages and bundle folders.
Gives: files written and packages installed atomically, checksums and the manifest's file table,
named fault points before every write (the tests' crash and full-disk cases).
May import: runtime (and the top-level config and export_errors).

    files      packages installed atomically, text/JSON written atomically, temporaries swept, sizes
    integrity  sha256 and size of every file of a bundle, the manifest sections that record them
    faults     fault injection points (COHERE_FAULT), a named call before every write
"""
