<#
.SYNOPSIS
    Install MoE Desk for the current user (no administrator rights), or upgrade it in place.

.DESCRIPTION
    1. Finds Python 3.10-3.13 through the py launcher (py.exe -3.12, -3.11, -3.13, -3.10) and makes a private
       virtual environment from it; without one, unpacks the embeddable Python (python-embed-amd64.zip, bundled
       by setup.exe, or downloaded from python.org with -AllowPythonDownload) and uses that as the private Python.
    2. Installs PyTorch: the CUDA build when an NVIDIA driver answers (nvidia-smi) and the GPU can run MoE
       Desk's kernels (compute capability 7.5, RTX 20 series, or newer), with triton-windows; the CPU build
       otherwise.
    3. Installs MoE Desk from the source folder, and makes Start-menu and desktop shortcuts that start it with
       pythonw.exe (no console window).
    The user's data is never touched: chats and downloaded models in %LOCALAPPDATA%\MoE Desk and %APPDATA%\MoE Desk,
    settings in the registry (HKCU\Software\MoE Desk), and the Hugging Face cache.
    A log of the last run is kept in the install folder (install.log).

.EXAMPLE
    powershell -NoProfile -ExecutionPolicy Bypass -File installers\windows\install.ps1
#>
[CmdletBinding()]
param(
    # the MoE Desk source tree (pyproject.toml, app\, engine\, resources\); default: this checkout
    [string]$Source = (Join-Path $PSScriptRoot '..\..'),
    # the program folder: the private Python, the log, uninstall.ps1
    [string]$InstallDir = (Join-Path $env:LOCALAPPDATA 'Programs\MoE Desk'),
    # an embeddable Python zip to use when the py launcher has no suitable Python
    [string]$PythonZip = '',
    # without a suitable Python: download the embeddable Python (and pip) from python.org and PyPI
    [switch]$AllowPythonDownload,
    [switch]$Cpu,
    [switch]$Cuda,
    [switch]$NoDesktopShortcut,
    [switch]$NoShortcuts,
    # the PyTorch requirement (default: torch>=2.4) and where it comes from (default: download.pytorch.org's
    # index for the chosen build; an empty MOEDESK_TORCH_INDEX_URL means pip's own configuration)
    [string]$TorchSpec = $env:MOEDESK_TORCH_SPEC,
    [string]$TorchIndexUrl = $env:MOEDESK_TORCH_INDEX_URL,
    # triton-windows requirement; default: the release line that matches the installed PyTorch
    [string]$TritonSpec = ''
)

$ErrorActionPreference = 'Stop'
Set-StrictMode -Version 3

$AppName = 'MoE Desk'
$Marker = '.moedesk-install'
$MinComputeCapability = [version]'7.5'   # engine/runtime/placement.py
$TorchIndex = 'https://download.pytorch.org/whl'
$EmbeddedPythonVersion = '3.12.10'       # for -AllowPythonDownload
$PythonVersions = @('3.12', '3.11', '3.13', '3.10')

function Say([string]$Text) { Write-Host $Text }
function Fail([string]$Text) { throw "MoE Desk installer: $Text" }

function Invoke-Checked {
    # run a program; stop with its name when it fails (native programs do not throw on their own)
    param([string]$Program, [string[]]$Arguments)
    & $Program @Arguments
    if ($LASTEXITCODE -ne 0) { Fail "$Program $($Arguments -join ' ') failed (exit code $LASTEXITCODE)" }
}

function Test-PythonVersion([string]$Python) {
    & $Python -c "import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] < (3, 14) and sys.maxsize > 2**32 else 1)" 2>$null
    return ($LASTEXITCODE -eq 0)
}

function Find-LauncherPython {
    # the base interpreter behind py.exe -3.X, or $null
    $py = Get-Command 'py.exe' -ErrorAction SilentlyContinue
    if (-not $py) { return $null }
    foreach ($version in $PythonVersions) {
        $exe = & $py.Source "-$version" -c "import sys; print(sys.executable)" 2>$null
        if ($LASTEXITCODE -eq 0 -and $exe -and (Test-PythonVersion $exe.Trim())) { return $exe.Trim() }
    }
    return $null
}

function Get-PipWheel([string]$Folder) {
    # pip's wheel: bundled beside the embeddable zip (setup.exe's vendor folder), else downloaded from PyPI
    $bundled = Get-ChildItem -Path $Folder -Filter 'pip-*.whl' -ErrorAction SilentlyContinue | Select-Object -First 1
    if ($bundled) { return $bundled.FullName }
    if (-not $AllowPythonDownload) { Fail "no pip wheel beside $PythonZip (run again with -AllowPythonDownload)" }
    $release = Invoke-RestMethod -Uri 'https://pypi.org/pypi/pip/json' -UseBasicParsing
    $wheel = $release.urls | Where-Object { $_.packagetype -eq 'bdist_wheel' } | Select-Object -First 1
    $path = Join-Path $env:TEMP $wheel.filename
    Invoke-WebRequest -Uri $wheel.url -OutFile $path -UseBasicParsing
    return $path
}

function Install-EmbeddedPython([string]$Target) {
    # the embeddable Python is private to us already: it is the environment (no venv module in it)
    $zip = $PythonZip
    if (-not $zip -or -not (Test-Path $zip)) {
        if (-not $AllowPythonDownload) {
            Fail ("no Python 3.10-3.13 found. Install Python 3.12 from python.org or the Microsoft Store " +
                  "(winget install Python.Python.3.12), or run this again with -AllowPythonDownload")
        }
        $zip = Join-Path $env:TEMP "python-$EmbeddedPythonVersion-embed-amd64.zip"
        Say "Downloading Python $EmbeddedPythonVersion (embeddable) from python.org"
        Invoke-WebRequest -UseBasicParsing -OutFile $zip `
            -Uri "https://www.python.org/ftp/python/$EmbeddedPythonVersion/python-$EmbeddedPythonVersion-embed-amd64.zip"
    }
    if (Test-Path $Target) { Remove-Item -Recurse -Force $Target }
    Expand-Archive -Path $zip -DestinationPath $Target
    # python3XX._pth fixes sys.path: let it read site-packages (pip and what pip installs go there)
    $pth = Get-ChildItem -Path $Target -Filter 'python3*._pth' | Select-Object -First 1
    if (-not $pth) { Fail "$zip is not an embeddable Python (no python3*._pth)" }
    $lines = Get-Content $pth.FullName | ForEach-Object { if ($_ -match '^#\s*import site') { 'import site' } else { $_ } }
    $lines = @($lines) + @('Lib\site-packages')
    Set-Content -Path $pth.FullName -Value $lines -Encoding ASCII
    $python = Join-Path $Target 'python.exe'
    $pipWheel = Get-PipWheel (Split-Path -Parent $zip)
    # a wheel is importable: pip installs itself from its own wheel
    Invoke-Checked $python @((Join-Path $pipWheel 'pip'), 'install', '--quiet', '--no-index', $pipWheel)
}

function Get-Nvidia {
    # @{ Ok; Name; Capability; DriverCuda } from nvidia-smi, or Ok = $false
    $smi = Get-Command 'nvidia-smi.exe' -ErrorAction SilentlyContinue
    if (-not $smi) {
        $candidate = Join-Path $env:SystemRoot 'System32\nvidia-smi.exe'
        if (Test-Path $candidate) { $smi = Get-Item $candidate }
    }
    $result = @{ Ok = $false; Name = 'an NVIDIA GPU'; Capability = $null; DriverCuda = $null }
    if (-not $smi) { return $result }
    $path = if ($smi -is [System.Management.Automation.CommandInfo]) { $smi.Source } else { $smi.FullName }
    $summary = & $path 2>$null
    if ($LASTEXITCODE -ne 0) { return $result }
    $result.Ok = $true
    $match = [regex]::Match(($summary -join "`n"), 'CUDA Version:\s*([0-9]+\.[0-9]+)')
    if ($match.Success) { $result.DriverCuda = [version]$match.Groups[1].Value }
    $caps = & $path '--query-gpu=compute_cap' '--format=csv,noheader' 2>$null
    if ($LASTEXITCODE -eq 0 -and $caps) {
        $result.Capability = @($caps | Where-Object { $_ -match '^\s*[0-9]+\.[0-9]+\s*$' } |
                              ForEach-Object { [version]$_.Trim() } | Sort-Object)[-1]
    }
    $names = & $path '--query-gpu=name' '--format=csv,noheader' 2>$null
    if ($LASTEXITCODE -eq 0 -and $names) { $result.Name = @($names)[0].Trim() }
    return $result
}

function Select-TorchBuild {
    # @{ Variant = 'cpu' | 'cu126' | 'cu128'; Why }
    if ($Cpu) { return @{ Variant = 'cpu'; Why = 'the CPU build was asked for (-Cpu)' } }
    $gpu = Get-Nvidia
    if (-not $gpu.Ok) {
        if ($Cuda) { return @{ Variant = 'cu128'; Why = 'the CUDA build was asked for (-Cuda)' } }
        return @{ Variant = 'cpu'; Why = 'no NVIDIA driver answered (nvidia-smi); install the NVIDIA driver and run this installer again to get the GPU build' }
    }
    if (-not $Cuda -and $gpu.Capability -and $gpu.Capability -lt $MinComputeCapability) {
        return @{ Variant = 'cpu'; Why = "$($gpu.Name) is compute capability $($gpu.Capability); MoE Desk's GPU kernels need $MinComputeCapability (RTX 20 series) or newer" }
    }
    if (-not $Cuda -and $gpu.DriverCuda -and $gpu.DriverCuda -lt [version]'12.0') {
        return @{ Variant = 'cpu'; Why = "the NVIDIA driver supports CUDA $($gpu.DriverCuda); PyTorch's GPU builds need CUDA 12 (driver 528 or newer): update the driver and run this installer again" }
    }
    $variant = if (-not $gpu.DriverCuda -or $gpu.DriverCuda -ge [version]'12.8') { 'cu128' } else { 'cu126' }
    return @{ Variant = $variant; Why = "$($gpu.Name), driver for CUDA $($gpu.DriverCuda)" }
}

function Get-TritonSpec([string]$Python) {
    # triton-windows 3.N goes with PyTorch 2.(N+4): 3.2 with 2.6, 3.3 with 2.7, 3.4 with 2.8 and so on
    if ($TritonSpec) { return $TritonSpec }
    $minor = & $Python -I -c "import torch; print(torch.__version__.split('.')[1])" 2>$null
    if ($LASTEXITCODE -ne 0 -or -not ($minor -match '^[0-9]+$')) { return 'triton-windows' }
    $triton = [int]$minor - 4
    return "triton-windows>=3.$triton,<3.$($triton + 1)"
}

function New-Shortcut([string]$Path, [string]$Target, [string]$Arguments, [string]$WorkingDirectory, [string]$Icon) {
    $shell = New-Object -ComObject WScript.Shell
    $link = $shell.CreateShortcut($Path)
    $link.TargetPath = $Target
    $link.Arguments = $Arguments
    $link.WorkingDirectory = $WorkingDirectory
    $link.IconLocation = "$Icon,0"
    $link.Description = 'Chat with mixture-of-experts language models on your own computer'
    $link.Save()
    Add-Content -Path (Join-Path $InstallDir 'installed-files.txt') -Value $Path
}

# --- the plan ----------------------------------------------------------------------------------------------
$Source = (Resolve-Path $Source).Path
foreach ($item in @('pyproject.toml', 'app', 'engine', 'resources')) {
    if (-not (Test-Path (Join-Path $Source $item))) { Fail "$Source is not a MoE Desk source tree (no $item)" }
}
New-Item -ItemType Directory -Force -Path $InstallDir | Out-Null
$InstallDir = (Resolve-Path $InstallDir).Path
$setupFiles = @('src', 'vendor', 'install.ps1', 'uninstall.ps1', 'wsl-shortcut.ps1', 'install.log')  # setup.exe's
$existing = @(Get-ChildItem -Force -Path $InstallDir | Where-Object { $_.Name -notlike 'unins*' -and $setupFiles -notcontains $_.Name })
if ($existing.Count -gt 0 -and -not (Test-Path (Join-Path $InstallDir $Marker))) {
    Fail "$InstallDir exists and was not made by this installer: choose another -InstallDir"
}
Start-Transcript -Path (Join-Path $InstallDir 'install.log') -Force | Out-Null
try {
    Set-Content -Path (Join-Path $InstallDir $Marker) -Value 'MoE Desk installer' -Encoding ASCII
    $build = Select-TorchBuild
    if (-not $TorchSpec) { $TorchSpec = 'torch>=2.4' }
    $indexArgs = @()
    if ($null -ne $env:MOEDESK_TORCH_INDEX_URL -or $PSBoundParameters.ContainsKey('TorchIndexUrl')) {
        if ($TorchIndexUrl) { $indexArgs = @('--index-url', $TorchIndexUrl) }
    } else {
        $indexArgs = @('--index-url', "$TorchIndex/$($build.Variant)")
    }
    Say "$AppName installer"
    Say "  source:   $Source"
    Say "  program:  $InstallDir"
    Say "  pytorch:  $TorchSpec, $($build.Variant) build ($($build.Why))"

    # --- Python: a venv from the py launcher's Python, else the embeddable Python ---------------------
    $venv = Join-Path $InstallDir 'venv'
    $embedded = Join-Path $InstallDir 'python'
    $python = $null
    if ((Test-Path (Join-Path $venv 'Scripts\python.exe')) -and (Test-PythonVersion (Join-Path $venv 'Scripts\python.exe'))) {
        $python = Join-Path $venv 'Scripts\python.exe'
        Say "Using the existing environment $venv"
    } elseif ((Test-Path (Join-Path $embedded 'python.exe')) -and (Test-PythonVersion (Join-Path $embedded 'python.exe'))) {
        $python = Join-Path $embedded 'python.exe'
        Say "Using the existing private Python $embedded"
    } else {
        $base = Find-LauncherPython
        if ($base) {
            Say "Creating a private Python environment in $venv (from $base)"
            if (Test-Path $venv) { Remove-Item -Recurse -Force $venv }
            Invoke-Checked $base @('-m', 'venv', $venv)
            $python = Join-Path $venv 'Scripts\python.exe'
        } else {
            Say "No Python 3.10-3.13 through the py launcher: using the embeddable Python in $embedded"
            Install-EmbeddedPython $embedded
            $python = Join-Path $embedded 'python.exe'
        }
    }
    $pythonw = Join-Path (Split-Path -Parent $python) 'pythonw.exe'
    $pip = @('-m', 'pip', 'install', '--disable-pip-version-check')

    # --- PyTorch (switching builds when the machine changed), triton-windows on CUDA --------------------
    $have = & $python -I -c "import torch; print('cuda' if torch.version.cuda else 'cpu')" 2>$null
    if ($LASTEXITCODE -ne 0) { $have = 'none' }
    $want = if ($build.Variant -eq 'cpu') { 'cpu' } else { 'cuda' }
    if ($have -ne 'none' -and $have -ne $want -and $indexArgs.Count -gt 0) {
        Say "Replacing the $have build of PyTorch with the $want build"
        Invoke-Checked $python @('-m', 'pip', 'uninstall', '--yes', '--quiet', 'torch')
    }
    Say "Installing PyTorch; the CUDA build is a few GB and takes a while"
    Invoke-Checked $python ($pip + $indexArgs + @($TorchSpec))
    if ($want -eq 'cuda') {
        $triton = Get-TritonSpec $python
        Say "Installing $triton (the GPU kernels' compiler)"
        & $python @($pip + @($triton))
        if ($LASTEXITCODE -ne 0) { Write-Warning "$triton did not install: the GPU kernels will not be available" }
    }

    # --- the app, from a clean copy of the source (the build leaves nothing in it) ----------------------
    $stage = Join-Path $env:TEMP ("moedesk-src-" + [guid]::NewGuid().ToString('N'))
    New-Item -ItemType Directory -Path $stage | Out-Null
    try {
        foreach ($item in @('pyproject.toml', 'README.md', 'LICENSE', 'app', 'engine', 'resources')) {
            $path = Join-Path $Source $item
            if (Test-Path $path) { Copy-Item -Recurse -Path $path -Destination $stage }
        }
        Get-ChildItem -Path $stage -Recurse -Directory -Filter '__pycache__' | Remove-Item -Recurse -Force
        Say "Installing MoE Desk from $Source"
        Invoke-Checked $python ($pip + @('--upgrade', '--upgrade-strategy', 'only-if-needed', ($stage + '[app]')))
    } finally {
        Remove-Item -Recurse -Force -Path $stage -ErrorAction SilentlyContinue
    }
    Invoke-Checked $python @('-I', '-W', 'ignore', '-c', 'import app.about, engine, PySide6.QtWidgets')

    # --- icon, shortcuts, uninstaller ------------------------------------------------------------------
    Set-Content -Path (Join-Path $InstallDir 'installed-files.txt') -Value @() -Encoding UTF8
    $icon = Join-Path $InstallDir 'moedesk.ico'
    Copy-Item -Force -Path (Join-Path $Source 'resources\icons\moedesk.ico') -Destination $icon
    foreach ($helper in @('uninstall.ps1', 'wsl-shortcut.ps1')) {  # setup.exe has put them there already
        $from = Join-Path $PSScriptRoot $helper
        $to = Join-Path $InstallDir $helper
        if ((Test-Path $from) -and ((Resolve-Path $from).Path -ne $to)) { Copy-Item -Force -Path $from -Destination $to }
    }
    if (-not $NoShortcuts) {
        # pythonw.exe: no console window. The working folder is the program folder, so that no app\ folder
        # elsewhere can stand in for the installed package (python -m puts the working folder on sys.path)
        $programs = [Environment]::GetFolderPath('Programs')
        New-Shortcut (Join-Path $programs "$AppName.lnk") $pythonw '-m app' $InstallDir $icon
        if (-not $NoDesktopShortcut) {
            $desktop = [Environment]::GetFolderPath('Desktop')
            New-Shortcut (Join-Path $desktop "$AppName.lnk") $pythonw '-m app' $InstallDir $icon
        }
    }
    $version = & $python -I -W ignore -c "from app.about import app_version; print(app_version())"
    Say ""
    Say "$AppName $version is installed. Start it from the Start menu$(if (-not $NoShortcuts -and -not $NoDesktopShortcut) { ' or the desktop' })."
    Say "Uninstall: powershell -ExecutionPolicy Bypass -File `"$InstallDir\uninstall.ps1`" (Settings > Apps after setup.exe); your models, chats and settings stay"
} finally {
    Stop-Transcript | Out-Null
}
