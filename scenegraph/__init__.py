"""scenegraph: the modelling API, scene files, importers and flatten(scene) -> Tape."""
