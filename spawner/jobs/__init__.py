"""Training jobs on the engines: the runner loop written once (`runner`) over a `JobBackend`, and one adapter per
engine: processes on the embedded pool (`local`), Volcano Jobs in a cluster (`volcano`, with the pure manifest
builders and status readers of `volcano_objects` and the pods' output kept by `podlogs`).
"""
