# A failing build: `broken` needs `fine`, prints to stdout and stderr, then exits 1; `after` needs
# `broken`, so it can never build. An evaluation of this flake fails, and keeps the builder's words.
{
  description = "Gradient example: a build that fails";

  outputs = { self }:
    let
      system = "x86_64-linux";
      salt = if builtins.pathExists ./salt then builtins.readFile ./salt else "";
      step = name: inputs: script: builtins.derivation {
        inherit name system salt inputs;
        builder = "/bin/sh";
        args = [ "-c" script ];
      };
      fine = step "fine" [ ] ''echo fine > $out'';
      broken = step "broken" [ fine ] ''
        echo "checking the answer"
        echo "error: the answer is not 42" >&2
        exit 1
      '';
      after = step "after-broken" [ broken ] ''echo never > $out'';
    in
    {
      packages.${system} = { inherit fine broken after; };
    };
}
