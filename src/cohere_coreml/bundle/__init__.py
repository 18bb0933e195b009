"""The bundle: the folder a client downloads, its manifest and what checks it.

Takes: the packages on disk and the checkpoint's tokenizer and config.
Gives: manifest.json (`write_bundle`), a checked `Bundle` (`Bundle.load`: every field the loop reads
and every package function's io), the Neural Engine census (`ane-check`).
May import: model, storage, runtime (and the top-level config and export_errors).

    format          name, version, file names and value sets of the format; `BundleError`
    packages        what a `.mlpackage` says about itself (io, metadata, buckets, parts, shapes)
    manifest        manifest.json built from the packages on disk, written last
    checks          the manifest's value checks, each failure naming its field
    package_checks  the manifest's io blocks against the packages themselves
    load            `Bundle.load`
    ane_check       `cohere-coreml ane-check`: every program against the published Neural Engine limits
"""

