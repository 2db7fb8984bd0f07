# A package and a check of it: checks.<system>.greeting-says-hello reads the package's output and
# fails unless it says hello.
{
  description = "Gradient example: a package and its check";

  outputs = { self }:
    let
      system = "x86_64-linux";
      salt = if builtins.pathExists ./salt then builtins.readFile ./salt else "";
      greeting = builtins.derivation {
        inherit system salt;
        name = "greeting";
        builder = "/bin/sh";
        args = [ "-c" ''echo hello > $out'' ];
      };
    in
    {
      packages.${system}.default = greeting;
      checks.${system}.greeting-says-hello = builtins.derivation {
        inherit system salt greeting;
        name = "greeting-says-hello";
        builder = "/bin/sh";
        args = [ "-c" ''
          read -r word < $greeting
          if [ "$word" != hello ]; then echo "the greeting says '$word'" >&2; exit 1; fi
          echo "the greeting says hello" > $out
        '' ];
      };
    };
}
