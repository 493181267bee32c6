"""The only package that imports MaxText: its seams (version-guarded, every touchpoint checked),
temoe's config schema, the adapter that turns MaxText's RoutedMoE into temoe's frozen MoE context,
MaxText's router glue, the metrics hook and the introspection the offline tools use."""

from temoe.maxtext.assets import use_packaged_assets

use_packaged_assets()  # before any MaxText import: MaxText reads MAXTEXT_ASSETS_ROOT once, at import
