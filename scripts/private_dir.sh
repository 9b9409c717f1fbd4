# Sourced by the scripts/gpu_*.sh scripts: directories under a shared /tmp that only this user can write.
#
# A directory whose path must stay the same across device calls on a warm machine (the unpacked stack, the carried
# parts, a kept model, a JSON that grows call by call) keeps its fixed name, checked with `private_dir`: made with
# mode 0700 when missing, refused when it is a symbolic link, another user's, or writable by group or others (another
# user could otherwise plant the code or data the next call runs). Everything that lives for one call only is a
# fresh `mktemp -d`.

# private_dir DIR NAME: make DIR (mode 0700) or accept it when it is this user's own; else say why, naming the
# variable NAME that moves it, and return 3.
private_dir() {
    local dir=$1 name=$2 owner mode
    if [[ -L "$dir" ]]; then
        echo "$dir is a symbolic link: remove it, or set $name to a directory of your own" >&2
        return 3
    fi
    mkdir -p -m 700 "$dir" || { echo "cannot create $dir: set $name to a directory of your own" >&2; return 3; }
    owner=$(stat -c %u "$dir") mode=$(stat -c %a "$dir")
    if [[ "$owner" != "$(id -u)" ]]; then
        echo "$dir belongs to uid $owner, not to you (uid $(id -u)): set $name to a directory of your own" >&2
        return 3
    fi
    if ((8#$mode & 8#022)); then
        echo "$dir is writable by group or others (mode $mode): chmod 700 $dir, or set $name elsewhere" >&2
        return 3
    fi
}
