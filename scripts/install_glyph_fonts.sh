#!/usr/bin/env bash
# Install the Debian/Ubuntu CJK font packages that `shardfc data glyphs` draws its identities from
# (59 faces; 20,971 ideographs of U+4E00-U+9FFF covered by at least 25 of them; about 15 s and
# 150 MB). Needs root or sudo and the distribution's package mirror; nothing else.
#
#   scripts/install_glyph_fonts.sh
#   shardfc data glyphs data/glyphs
#
# The package list is shardfc.data.glyphs.FONT_PACKAGES (a test keeps the two equal).
set -euo pipefail
PACKAGES=(fonts-noto-cjk fonts-arphic-ukai fonts-arphic-uming fonts-wqy-zenhei fonts-wqy-microhei
          fonts-ipafont-gothic fonts-ipafont-mincho fonts-droid-fallback fonts-vlgothic fonts-takao-mincho)
SUDO=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "install_glyph_fonts.sh: needs root or sudo to run apt-get" >&2; exit 2; }
  SUDO=sudo
fi
command -v apt-get >/dev/null || { echo "install_glyph_fonts.sh: no apt-get here; install these fonts with your package manager: ${PACKAGES[*]}" >&2; exit 2; }
export DEBIAN_FRONTEND=noninteractive
if ! $SUDO apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null; then
  $SUDO apt-get update -q >/dev/null
  $SUDO apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null
fi
echo "installed: ${PACKAGES[*]}"
